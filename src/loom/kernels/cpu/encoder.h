// Token + position embedding.
#pragma once

#include <cstdint>

#include "loom/kernels/cpu/matmul.h"  // Weight

namespace loom::cpu {

// out (B, T, C) = wte[tokens[b, t]] + wpe[t]; tokens (B, T), wte (V, C), wpe (maxT, C).
template <typename T>
void encoder_forward(T* out, const int32_t* tokens, WeightArg<T> wte, WeightArg<T> wpe, int64_t B,
                     int64_t Tn, int64_t C);

// Accumulates dwte[tokens[b, t]] += dout[b, t] and dwpe[t] += dout[b, t], each row's
// contributions summed apart first and added once.
template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B, int64_t Tn,
                      int64_t C);
// The same for the vocabulary rows [v0, v1) alone (a vocabulary-parallel
// rank's slice): dwte holds those rows; tokens outside add nothing there.
template <typename T>
void encoder_backward_rows(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B,
                           int64_t Tn, int64_t C, int64_t v0, int64_t v1);

}  // namespace loom::cpu
