#include "loom/kernels/cpu/precision.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "loom/core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace loom::cpu {

namespace {

// f16 conversions by the CPU's F16C instructions where it has them (8 at a
// time, ties to even as the scalar ones; a NaN keeps its sign and the top
// of its payload, quiet), else element by element.
#if defined(__x86_64__)
const bool kF16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");

__attribute__((target("avx2,f16c"))) void to_f16_f16c(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = f32_to_f16(x[i]);
}

__attribute__((target("avx2,f16c"))) void from_f16_f16c(const uint16_t* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  for (; i < n; ++i) out[i] = f16_to_f32(x[i]);
}
#else
const bool kF16c = false;
void to_f16_f16c(const float*, uint16_t*, int64_t) {}
void from_f16_f16c(const uint16_t*, float*, int64_t) {}
#endif

// One thread's part of a conversion: n elements, serially.
// f32_to_bf16 without its early return, so that the loop vectorises: ties
// to even, a NaN made quiet (the same bits).
inline uint16_t to_bf16_lanes(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

// bf16 rounding by the CPU's AVX512-BF16 instruction (32 at a time): ties
// to even and NaN made quiet as f32_to_bf16, but f32 subnormal inputs it
// reads as zero, so a block holding one is rounded by the formula instead
// (bit for bit f32_to_bf16 either way).
#if defined(__x86_64__)
const bool kAvx512Bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");

__attribute__((target("avx512f,avx512bw,avx512bf16"))) int64_t to_bf16_avx512(const float* x,
                                                                              uint16_t* out,
                                                                              int64_t n) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000), mantissa = _mm512_set1_epi32(0x007fffff);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + i + 16);
    const __m512i l = _mm512_castps_si512(lo), h = _mm512_castps_si512(hi);
    // Subnormal: exponent bits zero, mantissa not.
    const __mmask16 sub_l =
        _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(l, exponent), l, mantissa);
    const __mmask16 sub_h =
        _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(h, exponent), h, mantissa);
    if ((sub_l | sub_h) != 0) break;
    _mm512_storeu_si512(out + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
  return i;
}
#else
const bool kAvx512Bf16 = false;
int64_t to_bf16_avx512(const float*, uint16_t*, int64_t) {
  return 0;
}
#endif

void to_16_serial(const float* x, uint16_t* out, int64_t n, DType t) {
  if (t == DType::kBF16 && kAvx512Bf16) {
    // Blocks of 32 by the instruction until one holds a subnormal, that
    // block by the formula, and on.
    int64_t i = 0;
    while (i < n) {
      i += to_bf16_avx512(x + i, out + i, n - i);
      const int64_t end = std::min(n, i + 32);
      for (; i < end; ++i) out[i] = to_bf16_lanes(x[i]);
    }
  } else if (t == DType::kBF16) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = to_bf16_lanes(x[i]);
  } else if (kF16c) {
    to_f16_f16c(x, out, n);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(x[i]);
  }
}

void from_16_serial(const uint16_t* x, float* out, int64_t n, DType t) {
  if (t == DType::kBF16) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(x[i]);
  } else if (kF16c) {
    from_f16_f16c(x, out, n);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(x[i]);
  }
}

// Elements per piece of the chunked loops below (a multiple of 8).
constexpr int64_t kPiece = 1024;

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

void round_to_16_serial(const float* x, uint16_t* out, int64_t n, DType t) {
  check_16(t);
  to_16_serial(x, out, n, t);
}

void widen_16_serial(const uint16_t* x, float* out, int64_t n, DType t) {
  check_16(t);
  from_16_serial(x, out, n, t);
}

void round_to_16(const float* x, uint16_t* out, int64_t n, DType t) {
  check_16(t);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) to_16_serial(x + b, out + b, std::min(kPiece, n - b), t);
}

void widen_16(const uint16_t* x, float* out, int64_t n, DType t) {
  check_16(t);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece)
    from_16_serial(x + b, out + b, std::min(kPiece, n - b), t);
}

double sum_squares_16(const uint16_t* x, int64_t n, DType t) {
  check_16(t);
  if (t == DType::kBF16)
    return sum_squares_chunked(n, [x](int64_t i) { return double(bf16_to_f32(x[i])); });
  return sum_squares_chunked(n, [x](int64_t i) { return double(f16_to_f32(x[i])); });
}

void accumulate_16(const float* x, float scale, uint16_t* acc, int64_t n, DType t) {
  check_16(t);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) {
    const int64_t m = std::min(kPiece, n - b);
    float a[kPiece];
    from_16_serial(acc + b, a, m, t);
    for (int64_t i = 0; i < m; ++i) a[i] += x[b + i] * scale;
    to_16_serial(a, acc + b, m, t);
  }
}

void accumulate_16(const uint16_t* x, float scale, uint16_t* acc, int64_t n, DType t) {
  check_16(t);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) {
    const int64_t m = std::min(kPiece, n - b);
    float a[kPiece], y[kPiece];
    from_16_serial(acc + b, a, m, t);
    from_16_serial(x + b, y, m, t);
    for (int64_t i = 0; i < m; ++i) a[i] += y[i] * scale;
    to_16_serial(a, acc + b, m, t);
  }
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
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) {
    const int64_t len = std::min(kPiece, n - b);
    float g[kPiece];
    from_16_serial(grads + b, g, len, t);
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = b + k;
      const float gi = g[k] * grad_scale;
      const float mi = b1 * m[i] + (1.0f - b1) * gi;
      const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
      m[i] = mi;
      v[i] = vi;
      master[i] -= lr * (mi * c1 / (std::sqrt(vi * c2) + eps) + wd * master[i]);
    }
    to_16_serial(master + b, params + b, len, t);
  }
}

}  // namespace loom::cpu
