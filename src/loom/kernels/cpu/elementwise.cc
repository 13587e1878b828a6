#include "loom/kernels/cpu/elementwise.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "loom/core/error.h"
#include "loom/kernels/cpu/precision.h"
#include "loom/kernels/cpu/vec_math.h"

namespace loom::cpu {

namespace {
constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)

// One GELU value, for both forward kernels (so they agree bit for bit).
template <typename T>
inline T gelu_value(T x) {
  T u = T(kGeluScale) * (x + T(0.044715) * x * x * x);
  return T(0.5) * x * (T(1) + vtanh(u));
}
}  // namespace

template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_value(inp[i]);
}

void gelu_forward_16(uint16_t* out16, const float* inp, int64_t n, DType t) {
  // Checked here, not inside the parallel loop (an error there could not leave it).
  LOOM_CHECK(t == DType::kBF16 || t == DType::kF16, "gelu_forward_16 asked for {}", dtype_name(t));
  // Pieces of f32 values on the stack, each rounded while it is in cache.
  constexpr int64_t kPiece = 1024;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) {
    const int64_t m = std::min(kPiece, n - b);
    float y[kPiece];
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) y[i] = gelu_value(inp[b + i]);
    round_to_16_serial(y, out16 + b, m, t);
  }
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; ++i) {
    T x = inp[i];
    T u = T(kGeluScale) * (x + T(0.044715) * x * x * x);
    T th = vtanh(u);
    T sech2 = T(1) - th * th;
    T du = T(kGeluScale) * (T(1) + T(3 * 0.044715) * x * x);
    dinp[i] = dout[i] * (T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * du);
  }
}

template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void add_inplace(T* dst, const T* src, int64_t n) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

template <typename T>
void bias_add(T* y, const T* bias, int64_t N, int64_t C) {
#pragma omp parallel for
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < C; ++j) y[n * C + j] += bias[j];
}

template <typename T>
void axpy(T* y, T a, const T* x, int64_t n) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

namespace {
// Below this many elements a copy or fill runs on the calling thread.
constexpr int64_t kSerialElems = int64_t{1} << 16;
}  // namespace

template <typename T>
void copy(T* dst, const T* src, int64_t n) {
  if (n <= 0) return;
  if (n < kSerialElems) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
    return;
  }
#pragma omp parallel for
  for (int64_t i0 = 0; i0 < n; i0 += kSerialElems)
    std::memcpy(dst + i0, src + i0,
                static_cast<size_t>(std::min(kSerialElems, n - i0)) * sizeof(T));
}

template <typename T>
void fill(T* x, int64_t n, T value) {
  if (n <= 0) return;
  if (n < kSerialElems) {
    std::fill(x, x + n, value);
    return;
  }
#pragma omp parallel for
  for (int64_t i0 = 0; i0 < n; i0 += kSerialElems)
    std::fill(x + i0, x + std::min(n, i0 + kSerialElems), value);
}

template <typename T>
void dropout_residual_rows(T* out, const T* x, const T* residual, const DropoutSpec& spec,
                           int64_t Tn, int64_t C, int64_t row0, int64_t n) {
  if (!spec.active()) {
    if (residual != nullptr)
      residual_forward(out, x, residual, n * C);
    else if (out != x)
      copy(out, x, n * C);
    return;
  }
#pragma omp parallel
  {
    std::vector<T> keep(static_cast<size_t>(C));
#pragma omp for
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = (row0 + i) / Tn, t = (row0 + i) % Tn;
      spec.stream->row(spec.sample0 + static_cast<uint64_t>(b), spec.site, spec.position(t), 0, C,
                       keep.data());
      const T* xr = x + i * C;
      T* o = out + i * C;
      if (residual == nullptr) {
        for (int64_t c = 0; c < C; ++c) o[c] = xr[c] * keep[c];
      } else {
        const T* r = residual + i * C;
        for (int64_t c = 0; c < C; ++c) o[c] = xr[c] * keep[c] + r[c];
      }
    }
  }
}

template <typename T>
void dropout_rows(T* x, const DropoutSpec& spec, int64_t Tn, int64_t C, int64_t row0, int64_t n) {
  dropout_residual_rows<T>(x, x, nullptr, spec, Tn, C, row0, n);
}

template <typename T>
void dropout_inplace(T* x, const DropoutSpec& spec, int64_t B, int64_t Tn, int64_t C) {
  dropout_rows(x, spec, Tn, C, 0, B * Tn);
}

#define LOOM_INSTANTIATE(T)                                                                   \
  template void gelu_forward<T>(T*, const T*, int64_t);                                       \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t);                            \
  template void residual_forward<T>(T*, const T*, const T*, int64_t);                         \
  template void add_inplace<T>(T*, const T*, int64_t);                                        \
  template void bias_add<T>(T*, const T*, int64_t, int64_t);                                  \
  template void axpy<T>(T*, T, const T*, int64_t);                                            \
  template void copy<T>(T*, const T*, int64_t);                                               \
  template void fill<T>(T*, int64_t, T);                                                      \
  template void dropout_inplace<T>(T*, const DropoutSpec&, int64_t, int64_t, int64_t);        \
  template void dropout_rows<T>(T*, const DropoutSpec&, int64_t, int64_t, int64_t, int64_t);  \
  template void dropout_residual_rows<T>(T*, const T*, const T*, const DropoutSpec&, int64_t, \
                                         int64_t, int64_t, int64_t);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
