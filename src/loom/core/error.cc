#include "loom/core/error.h"

namespace loom {

void throw_check_failure(ErrorKind kind, const char* file, int line, const char* cond,
                         const std::string& message) {
  if (kind == ErrorKind::kInternal) {
    throw Error(kind, format("{}:{}: check failed: {}: {}", file, line, cond, message));
  }
  throw Error(kind, message);
}

}  // namespace loom
