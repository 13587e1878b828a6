#include "loom/kernels/cpu/layernorm.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/core/error.h"
#include "loom/kernels/cpu/precision.h"

namespace loom::cpu {

namespace {

// Row reductions in kLanes interleaved lanes, combined in lane order and
// then the ragged end, so that the loops vectorise and the result depends
// on C alone (not on threads or alignment).
constexpr int64_t kLanes = 16;

template <typename T>
T lane_sum(const T* lane) {
  T sum = 0;
  for (int64_t j = 0; j < kLanes; ++j) sum += lane[j];
  return sum;
}

// A row's mean and reciprocal standard deviation.
template <typename T>
void row_stats(const T* x, int64_t C, T& m, T& s) {
  T lane[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += x[c + j];
  T sum = lane_sum(lane);
  for (; c < C; ++c) sum += x[c];
  m = sum / T(C);
  std::fill(lane, lane + kLanes, T(0));
  for (c = 0; c + kLanes <= C; c += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lane[j] += (x[c + j] - m) * (x[c + j] - m);
  T var = lane_sum(lane);
  for (; c < C; ++c) var += (x[c] - m) * (x[c] - m);
  s = T(1) / std::sqrt(var / T(C) + T(kLayerNormEps));
}

// out[c] for c in [0, n): the one formula both forwards use, so that the
// 16-bit one is the f32 one rounded, bit for bit.
template <typename T>
inline void row_values(T* out, const T* x, T m, T s, const T* weight, const T* bias, int64_t n) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) out[c] = (x[c] - m) * s * weight[c] + bias[c];
}

}  // namespace

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                       int64_t N, int64_t C) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    T m, s;
    row_stats(inp + n * C, C, m, s);
    row_values(out + n * C, inp + n * C, m, s, weight, bias, C);
    mean[n] = m;
    rstd[n] = s;
  }
}

void layernorm_forward_16(uint16_t* out16, float* mean, float* rstd, const float* inp,
                          const float* weight, const float* bias, int64_t N, int64_t C, DType t) {
  // Checked here, not inside the parallel loop (an error there could not leave it).
  LOOM_CHECK(t == DType::kBF16 || t == DType::kF16, "layernorm_forward_16 asked for {}",
             dtype_name(t));
  constexpr int64_t kPiece = 1024;  // a row's values on the stack, rounded while in cache
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float m, s;
    row_stats(x, C, m, s);
    for (int64_t c = 0; c < C; c += kPiece) {
      const int64_t k = std::min(kPiece, C - c);
      float y[kPiece];
      row_values(y, x + c, m, s, weight + c, bias + c, k);
      round_to_16_serial(y, out16 + n * C + c, k, t);
    }
    mean[n] = m;
    rstd[n] = s;
  }
}

template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const T* mean, const T* rstd, int64_t N, int64_t C) {
  // dweight and dbias are sums over rows: each thread sums its rows into a
  // private copy, then the copies are added in thread order (deterministic
  // for a fixed thread count).
  int nthreads = omp_get_max_threads();
  std::vector<T> partial(static_cast<size_t>(nthreads) * 2 * C, T(0));
#pragma omp parallel
  {
    int tid = omp_get_thread_num();
    T* pw = partial.data() + static_cast<size_t>(tid) * 2 * C;
    T* pb = pw + C;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const T* x = inp + n * C;
      const T* d = dout + n * C;
      T m = mean[n], s = rstd[n];
      if (dinp != nullptr) {
        // dnorm = d * weight; dx = s * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)).
        T lane_dn[kLanes] = {}, lane_dx[kLanes] = {};
        int64_t k = 0;
        for (; k + kLanes <= C; k += kLanes)
          for (int64_t j = 0; j < kLanes; ++j) {
            T xhat = (x[k + j] - m) * s;
            T dn = d[k + j] * weight[k + j];
            lane_dn[j] += dn;
            lane_dx[j] += dn * xhat;
          }
        T dnorm_mean = lane_sum(lane_dn), dnorm_xhat_mean = lane_sum(lane_dx);
        for (; k < C; ++k) {
          T xhat = (x[k] - m) * s;
          T dn = d[k] * weight[k];
          dnorm_mean += dn;
          dnorm_xhat_mean += dn * xhat;
        }
        dnorm_mean /= T(C);
        dnorm_xhat_mean /= T(C);
        T* dx = dinp + n * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          T xhat = (x[c] - m) * s;
          T dn = d[c] * weight[c];
          dx[c] += s * (dn - dnorm_mean - xhat * dnorm_xhat_mean);
        }
      }
      if (dweight == nullptr) continue;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        T xhat = (x[c] - m) * s;
        pw[c] += d[c] * xhat;
        pb[c] += d[c];
      }
    }
  }
  if (dweight == nullptr) return;
  for (int t = 0; t < nthreads; ++t) {
    const T* pw = partial.data() + static_cast<size_t>(t) * 2 * C;
    for (int64_t c = 0; c < C; ++c) {
      dweight[c] += pw[c];
      dbias[c] += pw[C + c];
    }
  }
}

template void layernorm_forward<float>(float*, float*, float*, const float*, const float*,
                                       const float*, int64_t, int64_t);
template void layernorm_forward<double>(double*, double*, double*, const double*, const double*,
                                        const double*, int64_t, int64_t);
template void layernorm_backward<float>(float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*, int64_t, int64_t);
template void layernorm_backward<double>(double*, double*, double*, const double*, const double*,
                                         const double*, const double*, const double*, int64_t,
                                         int64_t);

}  // namespace loom::cpu
