// AdamW over the flat parameter buffer, with weight decay on matrices and
// embeddings only (biases and LayerNorm parameters are not decayed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/nn/param.h"

namespace loom {

struct OptimizerConfig {
  std::string type = "AdamW";  // "Adam" means the same (DeepSpeed's adam_w_mode default)
  double lr = 3e-4;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class AdamW {
 public:
  // Updates the elements [shard_begin, shard_end) of the flat buffers and keeps
  // moments for those alone (ZeRO stage 1 gives each data-parallel rank one
  // shard; the last may reach into the buffer's zero padding past the layout);
  // shard_end -1 means the whole layout.
  AdamW(const ParamLayout& layout, const OptimizerConfig& config, int64_t shard_begin = 0,
        int64_t shard_end = -1);
  // One update of the shard with rate `lr`; `step` is 1-based. params and
  // grads are the full flat buffers.
  void step(float* params, const float* grads, double lr, int64_t step);
  const OptimizerConfig& config() const { return config_; }
  int64_t shard_begin() const { return shard_begin_; }
  int64_t shard_end() const { return shard_end_; }
  // First and second moments of the shard: element i is flat element shard_begin + i.
  float* exp_avg() const { return m_.as<float>(); }
  float* exp_avg_sq() const { return v_.as<float>(); }

 private:
  struct Range {
    int64_t begin, end;
    bool decay;
  };
  OptimizerConfig config_;
  int64_t shard_begin_ = 0, shard_end_ = 0;
  std::vector<Range> ranges_;  // maximal runs of parameters with equal decay, within the shard
  Buffer m_, v_;
};

// Global gradient-norm clipping: returns the L2 norm of grads (n) before
// clipping and scales them by max_norm / norm when norm > max_norm > 0.
double clip_grad_norm(float* grads, int64_t n, double max_norm);

}  // namespace loom
