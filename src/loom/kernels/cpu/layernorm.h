// Layer normalisation over the last dimension, eps 1e-5 (GPT-2's).
#pragma once

#include <cstdint>

#include "loom/kernels/types.h"

namespace loom::cpu {

// out (N, C) = (inp - mean) * rstd * weight + bias; saves mean (N) and rstd (N).
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                       int64_t N, int64_t C);

// layernorm_forward<float>'s output rounded to t (kBF16 or kF16), bit for
// bit, written into out16 (N, C) and never stored in f32 (a LayerNorm whose
// output only the next linear's GEMMs read, in their 16-bit record twin).
void layernorm_forward_16(uint16_t* out16, float* mean, float* rstd, const float* inp,
                          const float* weight, const float* bias, int64_t N, int64_t C, DType t);

// Accumulates dinp (N, C), dweight (C), dbias (C). dinp may be null (then
// weight is not read); dweight and dbias are null together.
template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const T* mean, const T* rstd, int64_t N, int64_t C);

}  // namespace loom::cpu
