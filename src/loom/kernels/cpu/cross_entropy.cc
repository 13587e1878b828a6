#include "loom/kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "loom/kernels/cpu/vec_math.h"

namespace loom::cpu {

template <typename T>
void cross_entropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int64_t N,
                           int64_t V, int64_t Vp) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const T* row = logits + n * Vp;
    T mx = row[0];
    for (int64_t v = 1; v < V; ++v) mx = std::max(mx, row[v]);
    T sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += vexp(row[v] - mx);
    T l = mx + std::log(sum);
    lse[n] = l;
    losses[n] = l - row[targets[n]];
  }
}

template <typename T>
void cross_entropy_backward(T* logits, const T* lse, const int32_t* targets, const T* dloss,
                            int64_t N, int64_t V, int64_t Vp) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    T* row = logits + n * Vp;
    T l = lse[n], d = dloss[n];
    for (int64_t v = 0; v < V; ++v) row[v] = d * vexp(row[v] - l);
    row[targets[n]] -= d;
    std::fill(row + V, row + Vp, T(0));
  }
}

template void cross_entropy_forward<float>(float*, float*, const float*, const int32_t*, int64_t,
                                           int64_t, int64_t);
template void cross_entropy_forward<double>(double*, double*, const double*, const int32_t*,
                                            int64_t, int64_t, int64_t);
template void cross_entropy_backward<float>(float*, const float*, const int32_t*, const float*,
                                            int64_t, int64_t, int64_t);
template void cross_entropy_backward<double>(double*, const double*, const int32_t*, const double*,
                                             int64_t, int64_t, int64_t);

}  // namespace loom::cpu
