// Autoregressive sampling with a key/value cache.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/model/gpt_stage.h"

namespace loom {

struct SampleOptions {
  int64_t max_tokens = 100;
  double temperature = 0.8;  // 0: greedy (argmax)
  int64_t top_k = 40;        // 0: all tokens
  uint64_t seed = 0;         // the k-th draw is a function of (seed, k) alone
};

// Returns the `max_tokens` tokens that follow `prompt` (non-empty). When the
// context reaches seq_len, the cache restarts from the last seq_len / 2 tokens.
std::vector<uint32_t> generate(GptStage<float>& model, const std::vector<uint32_t>& prompt,
                               const SampleOptions& options);

// The next token from one row of logits (the first `vocab` entries count).
int sample_token(const float* logits, int vocab, double temperature, int64_t top_k, uint64_t seed,
                 uint64_t draw);

}  // namespace loom
