#include "loom/kernels/backend.h"

#include <algorithm>
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
      "gelu_forward_record_16",
      "gelu_backward_16",
      "residual_forward",
      "add",
      "bias_add",
      "dropout",
      "dropout_residual",
      "attention_forward",
      "attention_backward",
      "attention_forward_16",
      "attention_backward_16",
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
    case Op::kGeluForwardRecord16:
    case Op::kGeluBackward16:
    case Op::kAttentionForward16:
    case Op::kAttentionBackward16:
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
// By default GELU's recording forms are the f32 ones beside a rounding (a
// widening), as the attention's below.
template <typename T>
void Backend<T>::gelu_forward_record_16(float* out, uint16_t* out16, const float* inp,
                                        uint16_t* inp16, int64_t n, DType t) const {
  if constexpr (std::is_same_v<T, float>) {
    if (out16 != nullptr)
      gelu_forward_16(out16, inp, n, t);
    else
      gelu_forward(out, inp, n);
    round_16(inp, inp16, n, t);
  } else {
    (void)out, (void)out16, (void)inp, (void)inp16, (void)n, (void)t;
    unsupported(Op::kGeluForwardRecord16);
  }
}
template <typename T>
void Backend<T>::gelu_backward_16(float* dinp, const uint16_t* inp16, const float* dout, int64_t n,
                                  DType t) const {
  if constexpr (std::is_same_v<T, float>) {
    Buffer inp = alloc(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float),
                       MemCategory::kWorkspace, false);  // all written next
    widen_16(inp16, inp.as<float>(), n, t);
    gelu_backward(dinp, inp.as<float>(), dout, n);
  } else {
    (void)dinp, (void)inp16, (void)dout, (void)n, (void)t;
    unsupported(Op::kGeluBackward16);
  }
}
// By default the attention's 16-bit forms are the f32 ones beside a
// rounding (a widening): what any f32 backend computes, the definition the
// fused ones are held to.
template <typename T>
void Backend<T>::attention_forward_16(float* out, float* lse, const float* qkv, uint16_t* qkv16,
                                      int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                      const DropoutSpec& dropout) const {
  if constexpr (std::is_same_v<T, float>) {
    attention_forward(out, lse, qkv, B, Tn, C, NH, dropout);
    round_16(qkv, qkv16, B * Tn * 3 * C, DType::kBF16);
  } else {
    (void)out, (void)lse, (void)qkv, (void)qkv16, (void)B, (void)Tn, (void)C, (void)NH,
        (void)dropout;
    unsupported(Op::kAttentionForward16);
  }
}
template <typename T>
void Backend<T>::attention_backward_16(float* dqkv, const float* dout, const uint16_t* qkv16,
                                       const float* out, const float* lse, int64_t B, int64_t Tn,
                                       int64_t C, int64_t NH, const DropoutSpec& dropout) const {
  if constexpr (std::is_same_v<T, float>) {
    const int64_t n = B * Tn * 3 * C;
    Buffer qkv = alloc(static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float),
                       MemCategory::kWorkspace, false);  // all written next
    widen_16(qkv16, qkv.as<float>(), n, DType::kBF16);
    attention_backward(dqkv, dout, qkv.as<float>(), out, lse, B, Tn, C, NH, dropout);
  } else {
    (void)dqkv, (void)dout, (void)qkv16, (void)out, (void)lse, (void)B, (void)Tn, (void)C, (void)NH,
        (void)dropout;
    unsupported(Op::kAttentionBackward16);
  }
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
