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

// One GELU value.
template <typename T>
inline T gelu_value(T x) {
  T u = T(kGeluScale) * (x + T(0.044715) * x * x * x);
  return T(0.5) * x * (T(1) + vtanh(u));
}

// One GELU gradient.
template <typename T>
inline T gelu_grad(T x, T dout) {
  T u = T(kGeluScale) * (x + T(0.044715) * x * x * x);
  T th = vtanh(u);
  T sech2 = T(1) - th * th;
  T du = T(kGeluScale) * (T(1) + T(3 * 0.044715) * x * x);
  return dout * (T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * du);
}

// GELU's values come from vector lanes alone: a loop's scalar remainder
// may contract products into fused multiply-adds where its vector body
// does not, so that a value would depend on where a thread's part of the
// loop ends. The kernels run in pieces of kPiece elements (a multiple of
// every vector width), each piece's first multiple of 16 elements by one
// vector loop in place (gelu_piece, gelu_grad_piece; the build turns off
// peeling for alignment here) and the rest of the last piece through the
// same loop, zero-padded to 16 on the stack. A GELU value is then the same
// whatever the thread count and whichever kernel computes it (f32, 16-bit
// output, 16-bit input): the 16-bit forms are the f32 ones bit for bit.
constexpr int64_t kPiece = 1024;

// y (m16) = gelu(x), m16 a multiple of 16; y and x do not overlap (nor do
// any GELU kernel's output and inputs).
template <typename T>
__attribute__((noinline)) void gelu_piece(T* __restrict y, const T* __restrict x, int64_t m16) {
#pragma omp simd
  for (int64_t i = 0; i < m16; ++i) y[i] = gelu_value(x[i]);
}

// g (m16) = gelu'(x) * d, m16 a multiple of 16.
template <typename T>
__attribute__((noinline)) void gelu_grad_piece(T* __restrict g, const T* __restrict x,
                                               const T* __restrict d, int64_t m16) {
#pragma omp simd
  for (int64_t i = 0; i < m16; ++i) g[i] = gelu_grad(x[i], d[i]);
}

// gelu_piece over any m, the tail past the last multiple of 16 padded.
template <typename T>
void gelu_any(T* y, const T* x, int64_t m) {
  const int64_t body = m / 16 * 16;
  gelu_piece(y, x, body);
  if (body == m) return;
  alignas(64) T xt[16] = {}, yt[16];
  std::copy(x + body, x + m, xt);
  gelu_piece(yt, xt, 16);
  std::copy(yt, yt + (m - body), y + body);
}

template <typename T>
void gelu_grad_any(T* g, const T* x, const T* d, int64_t m) {
  const int64_t body = m / 16 * 16;
  gelu_grad_piece(g, x, d, body);
  if (body == m) return;
  alignas(64) T xt[16] = {}, dt[16] = {}, gt[16];
  std::copy(x + body, x + m, xt);
  std::copy(d + body, d + m, dt);
  gelu_grad_piece(gt, xt, dt, 16);
  std::copy(gt, gt + (m - body), g + body);
}

void check_16(DType t, const char* op) {
  // Checked before any parallel loop (an error there could not leave it).
  LOOM_CHECK(t == DType::kBF16 || t == DType::kF16, "{} asked for {}", op, dtype_name(t));
}
}  // namespace

template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) gelu_any(out + b, inp + b, std::min(kPiece, n - b));
}

namespace {
// GELU over pieces into out (f32) or out16 (rounded), and inp rounded into
// inp16 where that is not null.
void gelu_pieces_16(float* out, uint16_t* out16, const float* inp, uint16_t* inp16, int64_t n,
                    DType t) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) {
    const int64_t m = std::min(kPiece, n - b);
    if (out16 != nullptr) {
      float y[kPiece];
      gelu_any(y, inp + b, m);
      round_to_16_serial(y, out16 + b, m, t);
    } else {
      gelu_any(out + b, inp + b, m);
    }
    if (inp16 != nullptr) round_to_16_serial(inp + b, inp16 + b, m, t);
  }
}
}  // namespace

void gelu_forward_16(uint16_t* out16, const float* inp, int64_t n, DType t) {
  check_16(t, "gelu_forward_16");
  gelu_pieces_16(nullptr, out16, inp, nullptr, n, t);
}

void gelu_forward_record_16(float* out, uint16_t* out16, const float* inp, uint16_t* inp16,
                            int64_t n, DType t) {
  check_16(t, "gelu_forward_record_16");
  gelu_pieces_16(out, out16, inp, inp16, n, t);
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece)
    gelu_grad_any(dinp + b, inp + b, dout + b, std::min(kPiece, n - b));
}

void gelu_backward_16(float* dinp, const uint16_t* inp16, const float* dout, int64_t n, DType t) {
  check_16(t, "gelu_backward_16");
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) {
    const int64_t m = std::min(kPiece, n - b);
    float x[kPiece];
    widen_16_serial(inp16 + b, x, m, t);
    gelu_grad_any(dinp + b, x, dout + b, m);
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
