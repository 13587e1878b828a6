#include "loom/kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::cpu {

template <typename T>
void adamw_update(T* params, const T* grads, T* m, T* v, int64_t n, const AdamWParams& hp) {
  const T b1 = T(hp.beta1), b2 = T(hp.beta2);
  const T c1 = T(1.0 / (1.0 - std::pow(hp.beta1, double(hp.step))));
  const T c2 = T(1.0 / (1.0 - std::pow(hp.beta2, double(hp.step))));
  const T lr = T(hp.lr), eps = T(hp.eps), wd = T(hp.weight_decay);
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; ++i) {
    T g = grads[i];
    T mi = b1 * m[i] + (T(1) - b1) * g;
    T vi = b2 * v[i] + (T(1) - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    params[i] -= lr * (mi * c1 / (std::sqrt(vi * c2) + eps) + wd * params[i]);
  }
}

template <typename T>
double sum_squares(const T* x, int64_t n) {
  return sum_squares_chunked(n, [x](int64_t i) { return double(x[i]); });
}

template <typename T>
void scale_inplace(T* x, int64_t n, T s) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

template void adamw_update<float>(float*, const float*, float*, float*, int64_t,
                                  const AdamWParams&);
template void adamw_update<double>(double*, const double*, double*, double*, int64_t,
                                   const AdamWParams&);
template double sum_squares<float>(const float*, int64_t);
template double sum_squares<double>(const double*, int64_t);
template void scale_inplace<float>(float*, int64_t, float);
template void scale_inplace<double>(double*, int64_t, double);

}  // namespace loom::cpu
