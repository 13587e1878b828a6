#include "loom/core/error.h"

#include <atomic>

namespace loom {

namespace {
std::atomic<FatalHandler> g_fatal{nullptr};
// Per thread: what a destructor reached while this thread unwinds names.
thread_local std::string t_last;
}  // namespace

Error::Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {
  t_last = what;
}

void set_fatal_handler(FatalHandler handler) {
  g_fatal = handler;
}

void fail_fast(const std::string& message) {
  if (FatalHandler h = g_fatal.load()) h(message);
}

std::string last_error() {
  return t_last;
}

void throw_check_failure(ErrorKind kind, const char* file, int line, const char* cond,
                         const std::string& message) {
  if (kind == ErrorKind::kInternal) {
    throw Error(kind, format("{}:{}: check failed: {}: {}", file, line, cond, message));
  }
  throw Error(kind, message);
}

}  // namespace loom
