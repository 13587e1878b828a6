// Softmax cross-entropy fused over the logits buffer: no probability tensor
// is kept; backward overwrites the logits with their gradient.
#pragma once

#include <cstdint>

#include "loom/core/dtype.h"

namespace loom::cpu {

// logits (N, Vp), of which the first V columns are real and the rest padding
// (excluded from the softmax). losses (N) = lse_n - logits[n, targets[n]];
// lse (N) saved for backward.
template <typename T>
void cross_entropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int64_t N,
                           int64_t V, int64_t Vp);

// In place: logits[n, v] := dloss[n] * (exp(logits[n, v] - lse[n]) - [v0 + v ==
// targets[n]]); padded columns become 0. dloss (N), e.g. 1 / N everywhere
// for a mean. v0: the first column's vocabulary index (a vocabulary-parallel
// rank's range; 0 in one process).
template <typename T>
void cross_entropy_backward(T* logits, const T* lse, const int32_t* targets, const T* dloss,
                            int64_t N, int64_t V, int64_t Vp, int64_t v0);

// dlogits16 (N, Vp) = cross_entropy_backward's values rounded to t (kBF16 or
// kF16), bit for bit; logits are only read.
void cross_entropy_backward_16(uint16_t* dlogits16, const float* logits, const float* lse,
                               const int32_t* targets, const float* dloss, int64_t N, int64_t V,
                               int64_t Vp, int64_t v0, DType t);

// A vocabulary-parallel rank's part of the loss (kernels/backend.h).
template <typename T>
void vocab_logit_stats(T* mx, T* target, const T* logits, const int32_t* targets, int64_t N,
                       int64_t V, int64_t Vp, int64_t v0);
template <typename T>
void vocab_sum_exp(T* sum, const T* logits, const T* mx, int64_t N, int64_t V, int64_t Vp);

}  // namespace loom::cpu
