#include "loom/infer/generate.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/rng.h"

namespace loom {

int sample_token(const float* logits, int vocab, double temperature, int64_t top_k, uint64_t seed,
                 uint64_t draw) {
  if (temperature <= 0) return static_cast<int>(std::max_element(logits, logits + vocab) - logits);
  std::vector<std::pair<float, int>> ranked(static_cast<size_t>(vocab));
  for (int v = 0; v < vocab; ++v) ranked[v] = {logits[v], v};
  size_t keep =
      top_k > 0 ? std::min<size_t>(static_cast<size_t>(top_k), ranked.size()) : ranked.size();
  std::partial_sort(ranked.begin(), ranked.begin() + static_cast<std::ptrdiff_t>(keep),
                    ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<double> p(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i)
    total += p[i] = std::exp((ranked[i].first - ranked[0].first) / temperature);
  auto bits =
      philox4x32({static_cast<uint32_t>(draw), static_cast<uint32_t>(draw >> 32), 0x73616d70u, 0},
                 {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  double u = uniform_from_bits(bits[0]) * total;
  for (size_t i = 0; i < keep; ++i)
    if ((u -= p[i]) < 0) return ranked[i].second;
  return ranked[keep - 1].second;
}

std::vector<uint32_t> generate(GptStage<float>& model, const std::vector<uint32_t>& prompt,
                               const SampleOptions& o) {
  LOOM_CHECK_KIND(kConfig, !prompt.empty(), "generation needs a non-empty prompt");
  const GptConfig& c = model.config();
  for (uint32_t t : prompt)
    LOOM_CHECK_KIND(kData, t < static_cast<uint32_t>(c.vocab_size),
                    "prompt token {} is beyond the model's vocabulary ({})", t, c.vocab_size);
  KvCache<float> cache = model.make_kv_cache();
  std::vector<uint32_t> all = prompt;
  // Feed the context (at most seq_len tokens) and return the last logits.
  auto refill = [&](size_t keep) {
    cache.len = 0;
    const float* logits = nullptr;
    for (size_t i = all.size() - keep; i < all.size(); ++i)
      logits = model.decode_step(cache, static_cast<int32_t>(all[i]));
    return logits;
  };
  const float* logits = refill(std::min<size_t>(all.size(), static_cast<size_t>(c.seq_len)));
  for (int64_t k = 0; k < o.max_tokens; ++k) {
    int next = sample_token(logits, c.vocab_size, o.temperature, o.top_k, o.seed,
                            static_cast<uint64_t>(k));
    all.push_back(static_cast<uint32_t>(next));
    if (k + 1 == o.max_tokens) break;
    if (cache.len == c.seq_len)
      logits = refill(std::max<size_t>(1, static_cast<size_t>(c.seq_len) / 2));
    else
      logits = model.decode_step(cache, next);
  }
  return {all.begin() + static_cast<std::ptrdiff_t>(prompt.size()), all.end()};
}

}  // namespace loom
