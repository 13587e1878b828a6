// Counter-based random numbers (Philox-4x32-10). A value is a pure function
// of (key, counter), so any rank can produce element i of any tensor without
// producing the elements before it: initialisation is keyed on (seed,
// parameter name, global element index) and dropout on (seed, step, sample,
// position, layer), whatever the parallel layout (DESIGN.md, principle 1).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace loom {

using PhiloxKey = std::array<uint32_t, 2>;
using PhiloxCounter = std::array<uint32_t, 4>;

// Ten rounds of Philox-4x32 on `counter` under `key`.
std::array<uint32_t, 4> philox4x32(PhiloxCounter counter, PhiloxKey key);

// philox4x32 on kPhiloxLanes counters at once (word w of counter l in
// x[w][l], replaced by the result), bit for bit, through the CPU's widest
// vector unit (kBest) or the path named, where the CPU has it (philox_runs).
inline constexpr int kPhiloxLanes = 16;
enum class PhiloxPath { kBest, kScalar, kAvx2, kAvx512 };
bool philox_runs(PhiloxPath path);
void philox4x32_lanes(uint32_t (&x)[4][kPhiloxLanes], PhiloxKey key,
                      PhiloxPath path = PhiloxPath::kBest);

// 64-bit FNV-1a of a name: the stream id of a named tensor.
uint64_t name_hash(std::string_view name);

// A 32-bit value in [0, 1): the top 24 bits, so 1.0 is never produced.
inline float uniform_from_bits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

// Element i of a N(mean, std) tensor identified by (seed, name).
// Two normals come from one Philox call by Box-Muller; element i uses pair
// member i % 2 of counter i / 2.
class NormalStream {
 public:
  NormalStream(uint64_t seed, std::string_view name);
  float at(uint64_t index) const;  // standard normal

 private:
  PhiloxKey key_;
  uint32_t stream_hi_;
};

// Keep-masks for dropout: element (step, sample, site, position, channel)
// is kept with probability 1 - p. `site` identifies the layer and the place
// in it (embedding, attention probabilities, residual after attention or MLP).
class DropoutStream {
 public:
  DropoutStream(uint64_t seed, uint64_t step, float p);
  // Fills keep[0, end - begin) for channels [begin, end) of one (sample, site,
  // position) row: 1/(1-p) when kept, 0 when dropped. begin % 4 == 0.
  template <typename T>
  void row(uint64_t sample, uint32_t site, uint32_t position, int64_t begin, int64_t end,
           T* keep) const;
  float p() const { return p_; }
  // What a device kernel needs to draw the same masks: element c of a row
  // is kept when word c % 4 of philox4x32({sample_lo, site, position,
  // (sample_hi << 18) + c / 4}, key()) >= threshold().
  const PhiloxKey& key() const { return key_; }
  uint32_t threshold() const { return threshold_; }

 private:
  PhiloxKey key_;  // from (seed, step)
  float p_;
  uint32_t threshold_;  // keep when the 32-bit draw >= threshold_
};

// Site ids: the layer in the high bits, the place in the low bits, and for
// attention the head folded in by the caller: (layer + 1) in bits 18-31
// (model.n_layer <= 4096 < 2^14), the place in bits 16-17, the head in
// bits 0-15 (model.n_head <= 2^16), so no two sites of a model coincide.
enum class DropoutSite : uint32_t { kEmbedding = 0, kAttnProbs = 1, kAttnResid = 2, kMlpResid = 3 };
inline uint32_t dropout_site(int layer, DropoutSite s, uint32_t extra = 0) {
  return (static_cast<uint32_t>(layer + 1) << 18) | (static_cast<uint32_t>(s) << 16) | extra;
}

}  // namespace loom
