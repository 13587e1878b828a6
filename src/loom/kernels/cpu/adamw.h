// AdamW over a flat range of parameters and global gradient-norm clipping.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "loom/kernels/types.h"

namespace loom::cpu {

// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd p). n elements.
template <typename T>
void adamw_update(T* params, const T* grads, T* m, T* v, int64_t n, const AdamWParams& hp);

// sum of squares of x (n), accumulated in double.
template <typename T>
double sum_squares(const T* x, int64_t n);

// The sum of squares of load(0) .. load(n - 1) (doubles) over fixed chunks
// of 2^16 summed in chunk order, each chunk in eight interleaved lanes
// summed in lane order: the result depends neither on the thread count nor
// on the stored type (sum_squares and sum_squares_16 agree bit for bit on
// the same values), and the lanes vectorise.
template <typename Load>
double sum_squares_chunked(int64_t n, Load load) {
  constexpr int64_t kChunk = 1 << 16, kLanes = 8;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double lane[kLanes] = {};
    const int64_t end = std::min(n, (c + 1) * kChunk);
    int64_t i = c * kChunk;
    for (; i + kLanes <= end; i += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) {
        const double w = load(i + j);
        lane[j] += w * w;
      }
    double acc = 0;
    for (int64_t j = 0; j < kLanes; ++j) acc += lane[j];
    for (; i < end; ++i) {
      const double w = load(i);
      acc += w * w;
    }
    partial[static_cast<size_t>(c)] = acc;
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

// x (n) *= s.
template <typename T>
void scale_inplace(T* x, int64_t n, T s);

}  // namespace loom::cpu
