#include "loom/kernels/cpu/encoder.h"

#include <algorithm>

namespace loom::cpu {

template <typename T>
void encoder_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int64_t B,
                     int64_t Tn, int64_t C) {
#pragma omp parallel for collapse(2)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Tn; ++t) {
      T* o = out + (b * Tn + t) * C;
      const T* e = wte + static_cast<int64_t>(tokens[b * Tn + t]) * C;
      const T* p = wpe + t * C;
      for (int64_t c = 0; c < C; ++c) o[c] = e[c] + p[c];
    }
  }
}

template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B, int64_t Tn,
                      int64_t C) {
  // Tokens repeat, so rows of dwte are shared between positions: split the
  // work by channel blocks instead, so no two threads touch one element.
  constexpr int64_t kBlock = 32;
#pragma omp parallel for
  for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
    int64_t c1 = std::min(C, c0 + kBlock);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < Tn; ++t) {
        const T* d = dout + (b * Tn + t) * C;
        T* e = dwte + static_cast<int64_t>(tokens[b * Tn + t]) * C;
        T* p = dwpe + t * C;
        for (int64_t c = c0; c < c1; ++c) {
          e[c] += d[c];
          p[c] += d[c];
        }
      }
    }
  }
}

template void encoder_forward<float>(float*, const int32_t*, const float*, const float*, int64_t,
                                     int64_t, int64_t);
template void encoder_forward<double>(double*, const int32_t*, const double*, const double*,
                                      int64_t, int64_t, int64_t);
template void encoder_backward<float>(float*, float*, const float*, const int32_t*, int64_t,
                                      int64_t, int64_t);
template void encoder_backward<double>(double*, double*, const double*, const int32_t*, int64_t,
                                       int64_t, int64_t);

}  // namespace loom::cpu
