#include "loom/core/rng.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace loom {

namespace {
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// philox4x32_lanes's vector paths do philox4x32's arithmetic lane for lane:
// the 32 x 32 -> 64-bit products of the even lanes and of the odd lanes
// shifted down, their halves blended back into 32-bit lanes.
constexpr int kLanes = kPhiloxLanes;

#if defined(__x86_64__)
const bool kAvx512 = __builtin_cpu_supports("avx512f");
const bool kAvx2 = __builtin_cpu_supports("avx2");

// (The maskz forms with every lane set: GCC 12 warns inside the plain
// forms' headers, bug 105593.)
__attribute__((target("avx512f"))) inline void mulhilo16(__m512i a, __m512i m, __m512i& hi,
                                                         __m512i& lo) {
  constexpr __mmask8 kAll = 0xFF;
  const __m512i even = _mm512_maskz_mul_epu32(kAll, a, m);
  const __m512i odd = _mm512_maskz_mul_epu32(kAll, _mm512_maskz_srli_epi64(kAll, a, 32), m);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_maskz_slli_epi64(kAll, odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_maskz_srli_epi64(kAll, even, 32), odd);
}

__attribute__((target("avx512f"))) void philox_lanes_avx512(uint32_t (&x)[4][kLanes], PhiloxKey k) {
  __m512i c0 = _mm512_loadu_si512(x[0]), c1 = _mm512_loadu_si512(x[1]);
  __m512i c2 = _mm512_loadu_si512(x[2]), c3 = _mm512_loadu_si512(x[3]);
  const __m512i m0 = _mm512_set1_epi64(kMul0), m1 = _mm512_set1_epi64(kMul1);
  for (int round = 0; round < 10; ++round) {
    __m512i hi0, lo0, hi1, lo1;
    mulhilo16(c0, m0, hi0, lo0);
    mulhilo16(c2, m1, hi1, lo1);
    c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k[0])));
    c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k[1])));
    c1 = lo1, c3 = lo0;
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  _mm512_storeu_si512(x[0], c0), _mm512_storeu_si512(x[1], c1);
  _mm512_storeu_si512(x[2], c2), _mm512_storeu_si512(x[3], c3);
}

__attribute__((target("avx2"))) inline void mulhilo8(__m256i a, __m256i m, __m256i& hi,
                                                     __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

__attribute__((target("avx2"))) void philox_lanes_avx2(uint32_t (&x)[4][kLanes], PhiloxKey key) {
  for (int half = 0; half < kLanes; half += 8) {
    __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[0] + half));
    __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[1] + half));
    __m256i c2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[2] + half));
    __m256i c3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[3] + half));
    const __m256i m0 = _mm256_set1_epi64x(kMul0), m1 = _mm256_set1_epi64x(kMul1);
    PhiloxKey k = key;
    for (int round = 0; round < 10; ++round) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(c0, m0, hi0, lo0);
      mulhilo8(c2, m1, hi1, lo1);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k[0])));
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k[1])));
      c1 = lo1, c3 = lo0;
      k[0] += kWeyl0;
      k[1] += kWeyl1;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x[0] + half), c0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x[1] + half), c1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x[2] + half), c2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x[3] + half), c3);
  }
}
#else
const bool kAvx512 = false, kAvx2 = false;
void philox_lanes_avx512(uint32_t (&)[4][kLanes], PhiloxKey) {}
void philox_lanes_avx2(uint32_t (&)[4][kLanes], PhiloxKey) {}
#endif

}  // namespace

bool philox_runs(PhiloxPath path) {
  switch (path) {
    case PhiloxPath::kAvx512:
      return kAvx512;
    case PhiloxPath::kAvx2:
      return kAvx2;
    default:
      return true;
  }
}

void philox4x32_lanes(uint32_t (&x)[4][kPhiloxLanes], PhiloxKey k, PhiloxPath path) {
  if (path == PhiloxPath::kBest)
    path = kAvx512 ? PhiloxPath::kAvx512 : kAvx2 ? PhiloxPath::kAvx2 : PhiloxPath::kScalar;
  if (path == PhiloxPath::kAvx512 && kAvx512) {
    philox_lanes_avx512(x, k);
  } else if (path == PhiloxPath::kAvx2 && kAvx2) {
    philox_lanes_avx2(x, k);
  } else {
    for (int l = 0; l < kLanes; ++l) {
      const auto r = philox4x32({x[0][l], x[1][l], x[2][l], x[3][l]}, k);
      for (int w = 0; w < 4; ++w) x[w][l] = r[static_cast<size_t>(w)];
    }
  }
}

std::array<uint32_t, 4> philox4x32(PhiloxCounter c, PhiloxKey k) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c[0], hi0, lo0);
    mulhilo(kMul1, c[2], hi1, lo1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  return c;
}

uint64_t name_hash(std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

NormalStream::NormalStream(uint64_t seed, std::string_view name) {
  uint64_t h = name_hash(name);
  key_ = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  key_[0] ^= static_cast<uint32_t>(h);
  stream_hi_ = static_cast<uint32_t>(h >> 32);
}

float NormalStream::at(uint64_t index) const {
  uint64_t pair = index / 2;
  auto r = philox4x32(
      {static_cast<uint32_t>(pair), static_cast<uint32_t>(pair >> 32), stream_hi_, 0x6e6f726du},
      key_);
  // Box-Muller with u1 in (0, 1] so the log is finite.
  double u1 = (static_cast<double>(r[0]) + 1.0) / 4294967296.0;
  double u2 = static_cast<double>(r[1]) / 4294967296.0;
  double radius = std::sqrt(-2.0 * std::log(u1));
  double angle = 2.0 * M_PI * u2;
  return static_cast<float>(index % 2 == 0 ? radius * std::cos(angle) : radius * std::sin(angle));
}

DropoutStream::DropoutStream(uint64_t seed, uint64_t step, float p)
    : p_(p), threshold_(static_cast<uint32_t>(std::min(4294967295.0, std::ldexp(double(p), 32)))) {
  // One key per (seed, step), drawn from the seed's own Philox stream, so
  // the counter's four words are left for (sample, site, position, channel).
  const auto k = philox4x32(
      {static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32), 0x64726f70u, 0x6b657973u},
      {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  key_ = {k[0], k[1]};
}

template <typename T>
void DropoutStream::row(uint64_t sample, uint32_t site, uint32_t position, int64_t begin,
                        int64_t end, T* keep) const {
  T scale = T(1) / (T(1) - T(p_));
  // Channels take the low 18 bits of the last word (C <= 2^20, 4 per draw),
  // the sample's high bits the rest: no two elements of a run share a
  // counter within the config's limits.
  const uint32_t sample_lo = static_cast<uint32_t>(sample);
  const uint32_t sample_hi = static_cast<uint32_t>(sample >> 32) << 18;
  int64_t c0 = begin;
  // kLanes counters at a time through the CPU's vector units.
  for (; c0 + 4 * kLanes <= end; c0 += 4 * kLanes) {
    uint32_t x[4][kLanes];
    for (int l = 0; l < kLanes; ++l) {
      x[0][l] = sample_lo, x[1][l] = site, x[2][l] = position;
      x[3][l] = sample_hi + static_cast<uint32_t>(c0 / 4 + l);
    }
    philox4x32_lanes(x, key_);
    T* out = keep + (c0 - begin);
    for (int l = 0; l < kLanes; ++l)
      for (int w = 0; w < 4; ++w) out[4 * l + w] = x[w][l] >= threshold_ ? scale : T(0);
  }
  for (; c0 < end; c0 += 4) {
    auto r =
        philox4x32({sample_lo, site, position, sample_hi + static_cast<uint32_t>(c0 / 4)}, key_);
    for (int j = 0; j < 4 && c0 + j < end; ++j)
      keep[c0 - begin + j] = r[j] >= threshold_ ? scale : T(0);
  }
}

template void DropoutStream::row<float>(uint64_t, uint32_t, uint32_t, int64_t, int64_t,
                                        float*) const;
template void DropoutStream::row<double>(uint64_t, uint32_t, uint32_t, int64_t, int64_t,
                                         double*) const;

}  // namespace loom
