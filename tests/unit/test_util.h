// Helpers shared by the unit tests.
#pragma once

#include <functional>
#include <string>

#include "loom/core/error.h"

namespace loom::test {

// The message of the loom::Error that `f` throws, or "(no error)".
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace loom::test

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)
