// AdamW over a flat range of parameters and global gradient-norm clipping.
#pragma once

#include <cstdint>

#include "loom/kernels/types.h"

namespace loom::cpu {

// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd p). n elements.
template <typename T>
void adamw_update(T* params, const T* grads, T* m, T* v, int64_t n, const AdamWParams& hp);

// sum of squares of x (n), accumulated in double.
template <typename T>
double sum_squares(const T* x, int64_t n);

// x (n) *= s.
template <typename T>
void scale_inplace(T* x, int64_t n, T s);

}  // namespace loom::cpu
