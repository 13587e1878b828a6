// Errors: one typed exception and one check macro for all library code.
// Only main() turns an Error into an exit status.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace loom {

// What went wrong, for callers that react differently (the CLI maps kinds to
// exit messages; tests assert on kind and text).
enum class ErrorKind { kInternal, kConfig, kData, kIo, kComm, kUnsupported };

class Error : public std::runtime_error {
 public:
  // Also records the message as the process's latest error (see last_error).
  Error(ErrorKind kind, const std::string& what);
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// Fail-fast support for parallel jobs. A rank whose error unwinds past
// communication still in flight must not wait on its peers (they may wait on
// it): the MPI runtime installs a handler that prints the message with the
// rank and ends the whole job. Without one (one process, the unit tests),
// fail_fast returns and the caller goes on unwinding.
using FatalHandler = void (*)(const std::string& message);
void set_fatal_handler(FatalHandler handler);
// Ends the job with `message` when a handler is installed; returns otherwise.
void fail_fast(const std::string& message);
// The message of the latest Error constructed on this thread ("" if none):
// what a destructor reached while the thread unwinds names as the cause.
std::string last_error();

namespace detail {
inline void format_into(std::ostringstream& os, std::string_view fmt) {
  os << fmt;
}

template <typename T, typename... Rest>
void format_into(std::ostringstream& os, std::string_view fmt, const T& first,
                 const Rest&... rest) {
  size_t pos = fmt.find("{}");
  if (pos == std::string_view::npos) {
    os << fmt;
    return;
  }
  os << fmt.substr(0, pos) << first;
  format_into(os, fmt.substr(pos + 2), rest...);
}
}  // namespace detail

// format("a {} b {}", 1, "x") -> "a 1 b x". Each {} takes the next argument.
template <typename... Args>
std::string format(std::string_view fmt, const Args&... args) {
  std::ostringstream os;
  detail::format_into(os, fmt, args...);
  return os.str();
}

[[noreturn]] void throw_check_failure(ErrorKind kind, const char* file, int line, const char* cond,
                                      const std::string& message);

}  // namespace loom

// LOOM_CHECK(cond, "fmt {}", x): throws loom::Error (kind kInternal) recording
// the condition, file, line and the formatted values when cond is false.
#define LOOM_CHECK(cond, ...)                                                              \
  do {                                                                                     \
    if (!(cond))                                                                           \
      ::loom::throw_check_failure(::loom::ErrorKind::kInternal, __FILE__, __LINE__, #cond, \
                                  ::loom::format(__VA_ARGS__));                            \
  } while (0)

// LOOM_CHECK_KIND(kind, cond, ...): the same with a chosen kind. User-facing
// errors (config, data, I/O) carry only the message, without file and line.
#define LOOM_CHECK_KIND(kind, cond, ...)                                              \
  do {                                                                                \
    if (!(cond))                                                                      \
      ::loom::throw_check_failure(::loom::ErrorKind::kind, __FILE__, __LINE__, #cond, \
                                  ::loom::format(__VA_ARGS__));                       \
  } while (0)

#define LOOM_FAIL(kind, ...) \
  throw ::loom::Error(::loom::ErrorKind::kind, ::loom::format(__VA_ARGS__))
