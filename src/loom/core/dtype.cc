#include "loom/core/dtype.h"

#include <bit>
#include <cstring>

#include "loom/core/error.h"

namespace loom {

size_t dtype_size(DType t) {
  return t == DType::kF32 ? 4 : 2;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

DType dtype_from_name(std::string_view name) {
  if (name == "f32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  if (name == "f16") return DType::kF16;
  LOOM_FAIL(kConfig, "unknown dtype '{}' (expected f32, bf16 or f16)", name);
}

uint16_t f32_to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float bf16_to_f32(uint16_t x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x) << 16);
}

uint16_t f32_to_f16(float x) {
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

float f16_to_f32(uint16_t x) {
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

namespace {
float load(const void* src, DType t, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(src)[i];
    case DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
    case DType::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
  }
  return 0.0f;
}
void store(void* dst, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(dst)[i] = v;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(dst)[i] = f32_to_f16(v);
      break;
  }
}
}  // namespace

void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (src_type == dst_type) {
    std::memmove(dst, src, n * dtype_size(src_type));
    return;
  }
  for (size_t i = 0; i < n; ++i) store(dst, dst_type, i, load(src, src_type, i));
}

}  // namespace loom
