#include "loom/kernels/cpu/layernorm.h"

#include <omp.h>

#include <cmath>
#include <vector>

namespace loom::cpu {

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                       int64_t N, int64_t C) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    T sum = 0;
    for (int64_t c = 0; c < C; ++c) sum += x[c];
    T m = sum / T(C);
    T var = 0;
    for (int64_t c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    T s = T(1) / std::sqrt(var / T(C) + T(kLayerNormEps));
    T* o = out + n * C;
    for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - m) * s * weight[c] + bias[c];
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
        T dnorm_mean = 0, dnorm_xhat_mean = 0;
        for (int64_t c = 0; c < C; ++c) {
          T xhat = (x[c] - m) * s;
          T dn = d[c] * weight[c];
          dnorm_mean += dn;
          dnorm_xhat_mean += dn * xhat;
        }
        dnorm_mean /= T(C);
        dnorm_xhat_mean /= T(C);
        T* dx = dinp + n * C;
        for (int64_t c = 0; c < C; ++c) {
          T xhat = (x[c] - m) * s;
          T dn = d[c] * weight[c];
          dx[c] += s * (dn - dnorm_mean - xhat * dnorm_xhat_mean);
        }
      }
      if (dweight == nullptr) continue;
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
