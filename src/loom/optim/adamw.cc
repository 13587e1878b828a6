#include "loom/optim/adamw.h"

#include <cmath>

#include "loom/kernels/cpu/adamw.h"

namespace loom {

AdamW::AdamW(const ParamLayout& layout, const OptimizerConfig& config) : config_(config) {
  for (const Param& p : layout.params()) {
    if (!ranges_.empty() && ranges_.back().decay == p.decay) {
      ranges_.back().end = p.offset + p.numel;
    } else {
      ranges_.push_back({p.offset, p.offset + p.numel, p.decay});
    }
  }
  // Alignment padding between parameters is zero in params and grads and
  // stays zero under the update, so ranges may span it.
  for (size_t i = 0; i + 1 < ranges_.size(); ++i) ranges_[i].end = ranges_[i + 1].begin;
  if (!ranges_.empty()) ranges_.back().end = layout.total();
  size_t bytes = static_cast<size_t>(layout.total()) * sizeof(float);
  m_ = Buffer(bytes, MemCategory::kOptimizer);
  v_ = Buffer(bytes, MemCategory::kOptimizer);
}

void AdamW::step(float* params, const float* grads, double lr, int64_t step) {
  cpu::AdamWParams hp{lr, config_.beta1, config_.beta2, config_.eps, 0.0, step};
  for (const Range& r : ranges_) {
    hp.weight_decay = r.decay ? config_.weight_decay : 0.0;
    cpu::adamw_update(params + r.begin, grads + r.begin, m_.as<float>() + r.begin,
                      v_.as<float>() + r.begin, r.end - r.begin, hp);
  }
}

double clip_grad_norm(float* grads, int64_t n, double max_norm) {
  double norm = std::sqrt(cpu::sum_squares(grads, n));
  if (max_norm > 0 && norm > max_norm)
    cpu::scale_inplace(grads, n, static_cast<float>(max_norm / (norm + 1e-6)));
  return norm;
}

}  // namespace loom
