#include "loom/kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/kernels/cpu/vec_math.h"

namespace loom::cpu {

template <typename T>
void cross_entropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int64_t N,
                           int64_t V, int64_t Vp) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const T* row = logits + n * Vp;
    // The maximum and the sum of exponentials in kLanes interleaved lanes
    // (combined in lane order), so that both loops vectorise; the result
    // depends on neither the thread count nor the schedule.
    constexpr int64_t kLanes = 16;
    T lane[kLanes];
    std::fill(lane, lane + kLanes, row[0]);
    int64_t v = 0;
    for (; v + kLanes <= V; v += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) lane[j] = std::max(lane[j], row[v + j]);
    T mx = row[0];
    for (int64_t j = 0; j < kLanes; ++j) mx = std::max(mx, lane[j]);
    for (; v < V; ++v) mx = std::max(mx, row[v]);
    std::fill(lane, lane + kLanes, T(0));
    for (v = 0; v + kLanes <= V; v += kLanes)
      for (int64_t j = 0; j < kLanes; ++j) lane[j] += vexp(row[v + j] - mx);
    T sum = 0;
    for (int64_t j = 0; j < kLanes; ++j) sum += lane[j];
    for (; v < V; ++v) sum += vexp(row[v] - mx);
    T l = mx + std::log(sum);
    lse[n] = l;
    losses[n] = l - row[targets[n]];
  }
}

template <typename T>
void cross_entropy_backward(T* logits, const T* lse, const int32_t* targets, const T* dloss,
                            int64_t N, int64_t V, int64_t Vp, int64_t v0) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    T* row = logits + n * Vp;
    T l = lse[n], d = dloss[n];
    for (int64_t v = 0; v < V; ++v) row[v] = d * vexp(row[v] - l);
    std::fill(row + V, row + Vp, T(0));
    const int64_t t = targets[n] - v0;
    if (t >= 0 && t < Vp) row[t] -= d;
  }
}

template <typename T>
void vocab_logit_stats(T* mx, T* target, const T* logits, const int32_t* targets, int64_t N,
                       int64_t V, int64_t Vp, int64_t v0) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const T* l = logits + n * Vp;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < V; ++j) m = std::max(m, l[j]);
    mx[n] = m;
    const int64_t t = targets[n] - v0;
    target[n] = (t >= 0 && t < Vp) ? l[t] : T(0);
  }
}

template <typename T>
void vocab_sum_exp(T* sum, const T* logits, const T* mx, int64_t N, int64_t V, int64_t Vp) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const T* l = logits + n * Vp;
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(l[j] - mx[n]));
    sum[n] = static_cast<T>(s);
  }
}

template void cross_entropy_forward<float>(float*, float*, const float*, const int32_t*, int64_t,
                                           int64_t, int64_t);
template void cross_entropy_forward<double>(double*, double*, const double*, const int32_t*,
                                            int64_t, int64_t, int64_t);
#define LOOM_INSTANTIATE(T)                                                                       \
  template void cross_entropy_backward<T>(T*, const T*, const int32_t*, const T*, int64_t,        \
                                          int64_t, int64_t, int64_t);                             \
  template void vocab_logit_stats<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                     int64_t);                                                    \
  template void vocab_sum_exp<T>(T*, const T*, const T*, int64_t, int64_t, int64_t);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
