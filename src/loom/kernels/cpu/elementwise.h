// Elementwise kernels: GELU (tanh form), residual add, dropout.
#pragma once

#include <cstdint>

#include "loom/core/rng.h"

namespace loom::cpu {

// out (n) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n);
// Accumulates dinp += gelu'(inp) * dout.
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n);

// out (n) = a + b. (Its backward passes dout to both inputs; callers add.)
template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n);
// dst (n) += src.
template <typename T>
void add_inplace(T* dst, const T* src, int64_t n);

// Where a dropout mask applies to activations (B, T, C): which stream,
// which global samples (sample0 + b), and the site in the model.
struct DropoutSpec {
  const DropoutStream* stream = nullptr;  // null or p == 0: identity
  uint64_t sample0 = 0;
  uint32_t site = 0;
  bool active() const { return stream != nullptr && stream->p() > 0.0f; }
};

// x (B, T, C) *= keep mask of `spec`, in place. Backward is the same call on
// the gradient: the mask is recomputed from its key, never stored.
template <typename T>
void dropout_inplace(T* x, const DropoutSpec& spec, int64_t B, int64_t Tn, int64_t C);
// The same on rows [row0, row0 + n) of the flattened (B, T) grid, x (n, C):
// a rank holding a slice of the sequence (sequence parallelism) applies
// exactly the masks those rows have in one process.
template <typename T>
void dropout_rows(T* x, const DropoutSpec& spec, int64_t Tn, int64_t C, int64_t row0, int64_t n);

}  // namespace loom::cpu
