#include "loom/kernels/cpu/encoder.h"

#include <algorithm>
#include <vector>

namespace loom::cpu {

template <typename T>
void encoder_forward(T* out, const int32_t* tokens, WeightArg<T> wte, WeightArg<T> wpe, int64_t B,
                     int64_t Tn, int64_t C, const int32_t* pos) {
  const bool f32 = wte.w16 == nullptr && wpe.w16 == nullptr;
#pragma omp parallel for collapse(2)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Tn; ++t) {
      T* o = out + (b * Tn + t) * C;
      const int64_t e = static_cast<int64_t>(tokens[b * Tn + t]) * C;
      const int64_t p = (pos ? int64_t{pos[t]} : t) * C;
      if (f32) {
        for (int64_t c = 0; c < C; ++c) o[c] = wte.data[e + c] + wpe.data[p + c];
      } else {
        for (int64_t c = 0; c < C; ++c) o[c] = wte[e + c] + wpe[p + c];
      }
    }
  }
}

template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B, int64_t Tn,
                      int64_t C, int64_t v0, int64_t v1, const int32_t* pos) {
  // Each row's contributions are summed apart (positions in order) and added
  // to the gradient once, so a micro-batch's lookup gradient does not depend
  // on what the buffer held before: with the tied head's part already in it
  // (one stage) or not (the head in another stage's copy), one micro-batch's
  // wte gradient is bitwise the same. (Over several accumulated
  // micro-batches the two sum in different orders.)
  const int64_t BT = B * Tn;
  std::vector<int64_t> order;
  for (int64_t i = 0; i < BT; ++i)
    if (tokens[i] >= v0 && tokens[i] < v1) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [tokens](int64_t a, int64_t b) { return tokens[a] < tokens[b]; });
  // Rows of dwte are shared between positions: split the work by channel
  // blocks, so no two threads touch one element.
  constexpr int64_t kBlock = 32;
#pragma omp parallel for
  for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
    const int64_t n = std::min(C, c0 + kBlock) - c0;
    T acc[kBlock];
    for (size_t k = 0; k < order.size();) {
      const int32_t tok = tokens[order[k]];
      std::fill(acc, acc + n, T(0));
      for (; k < order.size() && tokens[order[k]] == tok; ++k) {
        const T* d = dout + order[k] * C + c0;
        for (int64_t c = 0; c < n; ++c) acc[c] += d[c];
      }
      T* e = dwte + (static_cast<int64_t>(tok) - v0) * C + c0;
      for (int64_t c = 0; c < n; ++c) e[c] += acc[c];
    }
    for (int64_t t = 0; t < Tn; ++t) {
      std::fill(acc, acc + n, T(0));
      for (int64_t b = 0; b < B; ++b) {
        const T* d = dout + (b * Tn + t) * C + c0;
        for (int64_t c = 0; c < n; ++c) acc[c] += d[c];
      }
      T* p = dwpe + (pos ? int64_t{pos[t]} : t) * C + c0;
      for (int64_t c = 0; c < n; ++c) p[c] += acc[c];
    }
  }
}

template <typename T>
void embedding_lookup(T* out, const int32_t* tokens, WeightArg<T> wte, int64_t N, int64_t C,
                      int64_t v0, int64_t v1) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n) {
    T* o = out + n * C;
    const int64_t tok = tokens[n];
    if (tok >= v0 && tok < v1 && wte.w16 == nullptr)
      std::copy(wte.data + (tok - v0) * C, wte.data + (tok - v0 + 1) * C, o);
    else if (tok >= v0 && tok < v1)
      for (int64_t c = 0; c < C; ++c) o[c] = wte[(tok - v0) * C + c];
    else
      std::fill(o, o + C, T(0));
  }
}

template <typename T>
void add_positions(T* out, WeightArg<T> wpe, int64_t Tn, int64_t C, int64_t row0, int64_t n,
                   const int32_t* pos) {
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = (row0 + i) % Tn, t = pos ? int64_t{pos[local]} : local;
    for (int64_t c = 0; c < C; ++c) out[i * C + c] += wpe[t * C + c];
  }
}

template void encoder_forward<float>(float*, const int32_t*, WeightArg<float>, WeightArg<float>,
                                     int64_t, int64_t, int64_t, const int32_t*);
template void encoder_forward<double>(double*, const int32_t*, WeightArg<double>, WeightArg<double>,
                                      int64_t, int64_t, int64_t, const int32_t*);
#define LOOM_INSTANTIATE(T)                                                                      \
  template void encoder_backward<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                    int64_t, int64_t, const int32_t*);                           \
  template void embedding_lookup<T>(T*, const int32_t*, WeightArg<T>, int64_t, int64_t, int64_t, \
                                    int64_t);                                                    \
  template void add_positions<T>(T*, WeightArg<T>, int64_t, int64_t, int64_t, int64_t,           \
                                 const int32_t*);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
