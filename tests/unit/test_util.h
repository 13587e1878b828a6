// Helpers shared by the unit tests.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

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

// n token ids drawn uniformly from [0, vocab) by a seeded generator.
inline std::vector<int32_t> tokens(int64_t n, int vocab, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(gen() % static_cast<uint32_t>(vocab));
  return t;
}

// A fresh folder under /tmp, removed with everything in it.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char tmpl[] = "/tmp/loom-test-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

}  // namespace loom::test

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)
