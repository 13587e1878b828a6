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
  AdamW(const ParamLayout& layout, const OptimizerConfig& config);
  // One update of every parameter with rate `lr`; `step` is 1-based.
  void step(float* params, const float* grads, double lr, int64_t step);
  const OptimizerConfig& config() const { return config_; }
  // First and second moments, laid out like the flat parameter buffer.
  float* exp_avg() const { return m_.as<float>(); }
  float* exp_avg_sq() const { return v_.as<float>(); }

 private:
  struct Range {
    int64_t begin, end;
    bool decay;
  };
  OptimizerConfig config_;
  std::vector<Range> ranges_;  // maximal runs of parameters with equal decay
  Buffer m_, v_;
};

// Global gradient-norm clipping: returns the L2 norm of grads (n) before
// clipping and scales them by max_norm / norm when norm > max_norm > 0.
double clip_grad_norm(float* grads, int64_t n, double max_norm);

}  // namespace loom
