#include "loom/kernels/cpu/precision.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/core/error.h"

namespace loom::cpu {

namespace {

void check_16(DType t) {
  LOOM_CHECK(t == DType::kBF16 || t == DType::kF16, "a 16-bit kernel asked for {}", dtype_name(t));
}

inline float widen(uint16_t x, DType t) {
  return t == DType::kBF16 ? bf16_to_f32(x) : f16_to_f32(x);
}

inline uint16_t narrow(float x, DType t) {
  return t == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
}

}  // namespace

void round_to_16(const float* x, uint16_t* out, int64_t n, DType t) {
  check_16(t);
  if (t == DType::kBF16) {
#pragma omp parallel for simd
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
  } else {
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(x[i]);
  }
}

void widen_16(const uint16_t* x, float* out, int64_t n, DType t) {
  check_16(t);
  if (t == DType::kBF16) {
#pragma omp parallel for simd
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i]);
  } else {
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(x[i]);
  }
}

double sum_squares_16(const uint16_t* x, int64_t n, DType t) {
  check_16(t);
  // The chunks of sum_squares<float>, summed in chunk order.
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double acc = 0;
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) {
      const double w = widen(x[i], t);
      acc += w * w;
    }
    partial[static_cast<size_t>(c)] = acc;
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

void accumulate_16(const float* x, float scale, uint16_t* acc, int64_t n, DType t) {
  check_16(t);
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) acc[i] = narrow(widen(acc[i], t) + x[i] * scale, t);
}

void accumulate_16(const uint16_t* x, float scale, uint16_t* acc, int64_t n, DType t) {
  check_16(t);
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) acc[i] = narrow(widen(acc[i], t) + widen(x[i], t) * scale, t);
}

void scale_16(uint16_t* x, int64_t n, float s, DType t) {
  check_16(t);
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) x[i] = narrow(widen(x[i], t) * s, t);
}

bool any_nonfinite_16(const uint16_t* x, int64_t n, DType t) {
  check_16(t);
  // Both formats: the exponent field all ones.
  const uint16_t mask = t == DType::kBF16 ? 0x7f80u : 0x7c00u;
  for (int64_t i = 0; i < n; ++i)
    if ((x[i] & mask) == mask) return true;
  return false;
}

void adamw_update_16(float* master, const uint16_t* grads, float grad_scale, float* m, float* v,
                     uint16_t* params, int64_t n, DType t, const AdamWParams& hp) {
  check_16(t);
  // The arithmetic of adamw_update<float>, term for term.
  const float b1 = float(hp.beta1), b2 = float(hp.beta2);
  const float c1 = float(1.0 / (1.0 - std::pow(hp.beta1, double(hp.step))));
  const float c2 = float(1.0 / (1.0 - std::pow(hp.beta2, double(hp.step))));
  const float lr = float(hp.lr), eps = float(hp.eps), wd = float(hp.weight_decay);
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    const float g = widen(grads[i], t) * grad_scale;
    const float mi = b1 * m[i] + (1.0f - b1) * g;
    const float vi = b2 * v[i] + (1.0f - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    master[i] -= lr * (mi * c1 / (std::sqrt(vi * c2) + eps) + wd * master[i]);
    params[i] = narrow(master[i], t);
  }
}

}  // namespace loom::cpu
