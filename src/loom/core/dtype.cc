#include "loom/core/dtype.h"

#include <bit>
#include <cstring>

#include "loom/core/error.h"

namespace loom {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kU8:
      return 1;
    case DType::kF64:
    case DType::kI64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kU8:
      return "u8";
    case DType::kF64:
      return "f64";
    case DType::kI64:
      return "i64";
  }
  return "?";
}

DType dtype_from_name(std::string_view name) {
  if (name == "f32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  if (name == "f16") return DType::kF16;
  LOOM_FAIL(kConfig, "unknown dtype '{}' (expected f32, bf16 or f16)", name);
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
    default:
      break;
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
    default:
      break;
  }
}
}  // namespace

void convert(const void* src, DType src_type, void* dst, DType dst_type, size_t n) {
  if (src_type == dst_type) {
    std::memmove(dst, src, n * dtype_size(src_type));
    return;
  }
  LOOM_CHECK(is_float_storage(src_type) && is_float_storage(dst_type),
             "no conversion from {} to {}", dtype_name(src_type), dtype_name(dst_type));
  for (size_t i = 0; i < n; ++i) store(dst, dst_type, i, load(src, src_type, i));
}

}  // namespace loom
