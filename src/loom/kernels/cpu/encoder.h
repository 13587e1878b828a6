// Token + position embedding.
#pragma once

#include <cstdint>

#include "loom/kernels/types.h"

namespace loom::cpu {

// out (B, T, C) = wte[tokens[b, t]] + wpe[pos[t]]; tokens (B, T), wte (V, C), wpe (maxT, C);
// pos null: t.
template <typename T>
void encoder_forward(T* out, const int32_t* tokens, WeightArg<T> wte, WeightArg<T> wpe, int64_t B,
                     int64_t Tn, int64_t C, const int32_t* pos);

// Accumulates dwte[tokens[b, t] - v0] += dout[b, t] for the tokens in [v0,
// v1) (dwte holds those rows: a vocabulary-parallel rank's slice; one
// process passes [0, V)) and dwpe[pos[t]] += dout[b, t], each row's
// contributions summed apart first and added once.
template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B, int64_t Tn,
                      int64_t C, int64_t v0, int64_t v1, const int32_t* pos);
// out (N, C) = wte[tokens[n] - v0] for tokens in [v0, v1), else 0.
template <typename T>
void embedding_lookup(T* out, const int32_t* tokens, WeightArg<T> wte, int64_t N, int64_t C,
                      int64_t v0, int64_t v1);
// out (n, C) += wpe[pos[(row0 + i) % Tn]] (pos null: the position itself).
template <typename T>
void add_positions(T* out, WeightArg<T> wpe, int64_t Tn, int64_t C, int64_t row0, int64_t n,
                   const int32_t* pos);

}  // namespace loom::cpu
