#include "loom/core/error.h"

#include <atomic>
#include <mutex>

namespace loom {

namespace {
std::atomic<FatalHandler> g_fatal{nullptr};
std::mutex g_last_mu;
std::string& last_message() {
  static std::string s;
  return s;
}
}  // namespace

Error::Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {
  std::lock_guard<std::mutex> lock(g_last_mu);
  last_message() = what;
}

void set_fatal_handler(FatalHandler handler) {
  g_fatal = handler;
}

void fail_fast(const std::string& message) {
  if (FatalHandler h = g_fatal.load()) h(message);
}

std::string last_error() {
  std::lock_guard<std::mutex> lock(g_last_mu);
  return last_message();
}

void throw_check_failure(ErrorKind kind, const char* file, int line, const char* cond,
                         const std::string& message) {
  if (kind == ErrorKind::kInternal) {
    throw Error(kind, format("{}:{}: check failed: {}: {}", file, line, cond, message));
  }
  throw Error(kind, message);
}

}  // namespace loom
