// exp and tanh that the compiler can vectorise (glibc's are scalar calls
// unless -ffast-math). float only; double keeps the library functions, since
// it serves as the precise reference in tests.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace loom::cpu {

// e^x for float with relative error below 1e-7 on [-87, 88]; smaller x gives
// a denormal-free tiny value (about 1e-38), larger gives about 1.7e38.
inline float vexp(float x) {
  // min/max and the round-by-adding-1.5*2^23 trick (instead of branches and
  // floor) keep the loop free of control flow, so it vectorises.
  x = std::max(-87.0f, std::min(88.0f, x));
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  float n = (x * 1.44269504088896341f + kRound) - kRound;
  // Cody-Waite: r = x - n ln2 in two parts, so r is exact to float precision.
  float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}
inline double vexp(double x) {
  return std::exp(x);
}

// tanh for float with absolute error below 1e-7.
inline float vtanh(float x) {
  float c = std::max(-9.0f, std::min(9.0f, x));
  float e = vexp(2.0f * c);
  return (e - 1.0f) / (e + 1.0f);
}
inline double vtanh(double x) {
  return std::tanh(x);
}

}  // namespace loom::cpu
