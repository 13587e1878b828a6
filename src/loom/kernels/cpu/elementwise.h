// Elementwise kernels: GELU (tanh form), residual add, dropout.
#pragma once

#include <cstdint>

#include "loom/kernels/types.h"

namespace loom::cpu {

// out (n) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n);
// gelu_forward's values rounded to t (kBF16 or kF16), bit for bit.
void gelu_forward_16(uint16_t* out16, const float* inp, int64_t n, DType t);
// Writes dinp = gelu'(inp) * dout over what dinp held.
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n);
// gelu_forward's values (rounded to t into out16 when it is not null, as
// gelu_forward_16, else into out) and inp16 = inp rounded to t, in one pass.
void gelu_forward_record_16(float* out, uint16_t* out16, const float* inp, uint16_t* inp16,
                            int64_t n, DType t);
// gelu_backward with inp read from its 16-bit values, bit for bit.
void gelu_backward_16(float* dinp, const uint16_t* inp16, const float* dout, int64_t n, DType t);

// out (n) = a + b. (Its backward passes dout to both inputs; callers add.)
template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n);
// dst (n) += src.
template <typename T>
void add_inplace(T* dst, const T* src, int64_t n);
// y (N, C) += bias (C) on every row.
template <typename T>
void bias_add(T* y, const T* bias, int64_t N, int64_t C);
// y (n) += a * x.
template <typename T>
void axpy(T* y, T a, const T* x, int64_t n);
// dst (n) = src; x (n) = value: large ones split across threads.
template <typename T>
void copy(T* dst, const T* src, int64_t n);
template <typename T>
void fill(T* x, int64_t n, T value);

// x (B, T, C) *= keep mask of `spec`, in place. Backward is the same call on
// the gradient: the mask is recomputed from its key, never stored.
template <typename T>
void dropout_inplace(T* x, const DropoutSpec& spec, int64_t B, int64_t Tn, int64_t C);
// The same on rows [row0, row0 + n) of the flattened (B, T) grid, x (n, C):
// a rank holding a slice of the sequence (sequence parallelism) applies
// exactly the masks those rows have in one process.
template <typename T>
void dropout_rows(T* x, const DropoutSpec& spec, int64_t Tn, int64_t C, int64_t row0, int64_t n);

// out (n, C) = x * the keep masks of those rows + residual (null: none),
// one pass; out may be x.
template <typename T>
void dropout_residual_rows(T* out, const T* x, const T* residual, const DropoutSpec& spec,
                           int64_t Tn, int64_t C, int64_t row0, int64_t n);

}  // namespace loom::cpu
