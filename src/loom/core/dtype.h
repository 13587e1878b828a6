// Element types. Storage and conversion for f32, bf16 and f16; compute is f32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

enum class DType : uint8_t { kF32, kBF16, kF16 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
DType dtype_from_name(std::string_view name);  // "f32" | "bf16" | "f16"; throws otherwise

// Round to nearest, ties to even; NaN stays NaN, overflow becomes infinity.
uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t x);
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t x);

// Bulk conversion between element types; n elements.
void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n);

}  // namespace loom
