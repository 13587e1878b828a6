#include "loom/core/rng.h"

#include <algorithm>
#include <cmath>

namespace loom {

namespace {
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}
}  // namespace

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
  for (int64_t c0 = begin; c0 < end; c0 += 4) {
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
