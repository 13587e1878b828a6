#include "loom/kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/core/error.h"
#include "loom/kernels/cpu/precision.h"
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
    if (t >= 0 && t < V) row[t] -= d;  // padding stays 0, as on every backend
  }
}

void cross_entropy_backward_16(uint16_t* dlogits16, const float* logits, const float* lse,
                               const int32_t* targets, const float* dloss, int64_t N, int64_t V,
                               int64_t Vp, int64_t v0, DType t) {
  // A row a piece at a time: the f32 gradient (cross_entropy_backward's
  // arithmetic, the target's column included where it is a real column) in
  // a buffer that stays in cache, rounded from there.
  LOOM_CHECK(t == DType::kBF16 || t == DType::kF16, "cross_entropy_backward_16 asked for {}",
             dtype_name(t));
  constexpr int64_t kPiece = 1024;
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const float* row = logits + n * Vp;
    uint16_t* out = dlogits16 + n * Vp;
    const float l = lse[n], d = dloss[n];
    const int64_t target = targets[n] - v0;
    float g[kPiece];
    for (int64_t b = 0; b < V; b += kPiece) {
      const int64_t len = std::min(kPiece, V - b);
      for (int64_t k = 0; k < len; ++k) g[k] = d * vexp(row[b + k] - l);
      if (target >= b && target < b + len) g[target - b] -= d;
      round_to_16_serial(g, out + b, len, t);
    }
    // The padding: zero in either 16-bit type.
    std::fill(out + V, out + Vp, uint16_t{0});
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
