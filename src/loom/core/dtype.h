// Element types. Storage and conversion for f32, bf16 and f16; compute is
// f32. u8, f64 and i64 are payloads for communication alone (bytes, exact
// statistics, counters): they travel as they are and reduce exactly, and do
// not convert to the others.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

enum class DType : uint8_t { kF32, kBF16, kF16, kU8, kF64, kI64 };
// f32, bf16, f16: the types tensors are stored in.
inline bool is_float_storage(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16;
}

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
DType dtype_from_name(std::string_view name);  // "f32" | "bf16" | "f16"; throws otherwise

// Round to nearest, ties to even; NaN stays NaN, overflow becomes infinity.
// Inline: the kernels that store 16-bit tensors convert element by element.
inline uint16_t f32_to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float bf16_to_f32(uint16_t x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x) << 16);
}

inline uint16_t f32_to_f16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65536: infinity
  if (abs < 0x38800000u) {                        // below the smallest normal 2^-14
    // Subnormal: value = m * 2^-24. Add 0.5 to round by float arithmetic,
    // whose round-to-nearest-even is the rule we want.
    float f = std::bit_cast<float>(abs);
    float scaled = f * 16777216.0f;  // 2^24, exact
    uint32_t m = static_cast<uint32_t>(scaled);
    float frac = scaled - static_cast<float>(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) m++;
    return sign | static_cast<uint16_t>(m);
  }
  // Normal: rebias the exponent (127 -> 15) and round the mantissa to 10 bits.
  uint32_t rebased = abs - ((127u - 15u) << 23);
  uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return sign | static_cast<uint16_t>((rebased + rounding) >> 13);
}

inline float f16_to_f32(uint16_t x) {
  uint32_t sign = static_cast<uint32_t>(x & 0x8000u) << 16;
  uint32_t exp = (x >> 10) & 0x1fu;
  uint32_t man = x & 0x3ffu;
  if (exp == 0) {
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);  // m * 2^-24
    return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

// Bulk conversion between element types; n elements.
void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace loom
