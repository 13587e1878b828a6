#include "loom/optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "loom/kernels/cpu/adamw.h"

namespace loom {

AdamW::AdamW(const ParamLayout& layout, const OptimizerConfig& config, int64_t shard_begin,
             int64_t shard_end)
    : config_(config),
      shard_begin_(shard_begin),
      shard_end_(shard_end < 0 ? layout.total() : shard_end) {
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
  std::vector<Range> mine;
  for (const Range& r : ranges_) {
    int64_t b = std::max(r.begin, shard_begin_), e = std::min(r.end, shard_end_);
    if (b < e) mine.push_back({b, e, r.decay});
  }
  ranges_ = std::move(mine);
  size_t bytes =
      static_cast<size_t>(std::max<int64_t>(0, shard_end_ - shard_begin_)) * sizeof(float);
  m_ = Buffer(bytes, MemCategory::kOptimizer);
  v_ = Buffer(bytes, MemCategory::kOptimizer);
}

void AdamW::step(float* params, const float* grads, double lr, int64_t step) {
  cpu::AdamWParams hp{lr, config_.beta1, config_.beta2, config_.eps, 0.0, step};
  for (const Range& r : ranges_) {
    hp.weight_decay = r.decay ? config_.weight_decay : 0.0;
    const int64_t local = r.begin - shard_begin_;
    cpu::adamw_update(params + r.begin, grads + r.begin, m_.as<float>() + local,
                      v_.as<float>() + local, r.end - r.begin, hp);
  }
}

double clip_grad_norm(float* grads, int64_t n, double max_norm) {
  double norm = std::sqrt(cpu::sum_squares(grads, n));
  if (max_norm > 0 && norm > max_norm)
    cpu::scale_inplace(grads, n, static_cast<float>(max_norm / (norm + 1e-6)));
  return norm;
}

}  // namespace loom
