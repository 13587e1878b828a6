// Seconds on the steady clock, the one loom times everything with.
#pragma once

#include <chrono>

namespace loom {

inline double seconds_between(std::chrono::steady_clock::time_point a,
                              std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return seconds_between(t0, std::chrono::steady_clock::now());
}

}  // namespace loom
