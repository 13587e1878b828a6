#include "loom/kernels/backend.h"

#include <array>
#include <type_traits>

#include "loom/core/error.h"

namespace loom {

const char* op_name(Op op) {
  static constexpr std::array<const char*, kNumOps> kNames = {
      "gemm",
      "matmul_forward",
      "matmul_backward",
      "matmul_nt_forward",
      "matmul_nt_backward",
      "layernorm_forward",
      "layernorm_backward",
      "layernorm_forward_16",
      "gelu_forward",
      "gelu_backward",
      "gelu_forward_16",
      "residual_forward",
      "add",
      "bias_add",
      "dropout",
      "dropout_residual",
      "attention_forward",
      "attention_backward",
      "attention_chunk_forward",
      "attention_chunk_backward",
      "cross_entropy_forward",
      "cross_entropy_backward",
      "cross_entropy_backward_16",
      "vocab_logit_stats",
      "vocab_sum_exp",
      "encoder_forward",
      "encoder_backward",
      "embedding_lookup",
      "add_positions",
      "adamw",
      "adamw_16",
      "sum_squares",
      "sum_squares_16",
      "scale",
      "scale_16",
      "round_16",
      "widen_16",
      "accumulate_16",
      "nonfinite_16",
      "copy",
      "fill",
      "axpy",
  };
  const int i = static_cast<int>(op);
  return i >= 0 && i < kNumOps ? kNames[static_cast<size_t>(i)] : "unknown";
}

bool is_16bit_op(Op op) {
  switch (op) {
    case Op::kAdamW16:
    case Op::kLayerNormForward16:
    case Op::kGeluForward16:
    case Op::kCrossEntropyBackward16:
    case Op::kSumSquares16:
    case Op::kScale16:
    case Op::kRound16:
    case Op::kWiden16:
    case Op::kAccumulate16:
    case Op::kNonfinite16:
      return true;
    default:
      return false;
  }
}

template <typename T>
bool Backend<T>::supports(Op op) const {
  if (op == Op::kCount) return false;
  return std::is_same_v<T, float> || !is_16bit_op(op);
}

template <typename T>
void Backend<T>::unsupported(Op op) const {
  LOOM_FAIL(kUnsupported, "backend {} does not support {}{}", name(), op_name(op),
            sizeof(T) == 8 ? " in f64" : "");
}

// The 16-bit operations: a backend without them says so.
template <typename T>
void Backend<T>::adamw_16(float*, const uint16_t*, float, float*, float*, uint16_t*, int64_t, DType,
                          const AdamWParams&) const {
  unsupported(Op::kAdamW16);
}
template <typename T>
double Backend<T>::sum_squares_16(const uint16_t*, int64_t, DType) const {
  unsupported(Op::kSumSquares16);
  return 0;
}
template <typename T>
void Backend<T>::scale_16(uint16_t*, int64_t, float, DType) const {
  unsupported(Op::kScale16);
}
template <typename T>
void Backend<T>::layernorm_forward_16(uint16_t*, float*, float*, const float*, const float*,
                                      const float*, int64_t, int64_t, DType) const {
  unsupported(Op::kLayerNormForward16);
}

template <typename T>
void Backend<T>::gelu_forward_16(uint16_t*, const float*, int64_t, DType) const {
  unsupported(Op::kGeluForward16);
}
template <typename T>
void Backend<T>::cross_entropy_backward_16(uint16_t*, const float*, const float*, const int32_t*,
                                           const float*, int64_t, int64_t, int64_t, int64_t,
                                           DType) const {
  unsupported(Op::kCrossEntropyBackward16);
}
template <typename T>
void Backend<T>::round_16(const float*, uint16_t*, int64_t, DType) const {
  unsupported(Op::kRound16);
}
template <typename T>
void Backend<T>::widen_16(const uint16_t*, float*, int64_t, DType) const {
  unsupported(Op::kWiden16);
}
template <typename T>
void Backend<T>::accumulate_16(const float*, const uint16_t*, float, uint16_t*, int64_t,
                               DType) const {
  unsupported(Op::kAccumulate16);
}
template <typename T>
bool Backend<T>::nonfinite_16(const uint16_t*, int64_t, DType) const {
  unsupported(Op::kNonfinite16);
  return true;
}

template class Backend<float>;
template class Backend<double>;

}  // namespace loom
