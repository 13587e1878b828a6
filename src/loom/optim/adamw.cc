#include "loom/optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/range.h"

namespace loom {

std::vector<AdamWSegment> adamw_segments(const ParamLayout& layout, int64_t begin, int64_t end) {
  // Maximal runs of equal decay over the layout; each run reaches the next
  // run's start (or the end of the layout), so padding belongs to a run.
  struct Run {
    int64_t begin, end;
    bool decay;
  };
  std::vector<Run> runs;
  for (const Param& p : layout.params()) {
    if (runs.empty() || runs.back().decay != p.decay) {
      if (!runs.empty()) runs.back().end = p.offset;
      runs.push_back({p.offset, p.offset + p.numel, p.decay});
    }
  }
  if (!runs.empty()) runs.back().end = layout.total();
  std::vector<AdamWSegment> out;
  for (const Run& r : runs) {
    const auto [b, e] = intersect({r.begin, r.end}, {begin, end});
    if (b < e) out.push_back({b, b, b, e - b, r.decay});
  }
  return out;
}

AdamW::AdamW(const ParamLayout& layout, const OptimizerConfig& config,
             const Backend<float>& backend)
    : AdamW(adamw_segments(layout, 0, layout.total()), layout.total(), config, nullptr, nullptr,
            backend) {}

AdamW::AdamW(std::vector<AdamWSegment> segments, int64_t state_elements,
             const OptimizerConfig& config, float* m, float* v, const Backend<float>& backend)
    : config_(config),
      be_(&backend),
      segments_(std::move(segments)),
      state_elements_(state_elements) {
  for (const AdamWSegment& s : segments_)
    LOOM_CHECK(s.state_offset >= 0 && s.state_offset + s.length <= state_elements_,
               "AdamW segment [{}, {}) outside the {} moments", s.state_offset,
               s.state_offset + s.length, state_elements_);
  if (m != nullptr && v != nullptr) {
    m_ = m, v_ = v;
    return;
  }
  const size_t bytes = static_cast<size_t>(state_elements_) * sizeof(float);
  m_owned_ = be_->alloc(bytes, MemCategory::kOptimizer);
  v_owned_ = be_->alloc(bytes, MemCategory::kOptimizer);
  m_ = m_owned_.as<float>(), v_ = v_owned_.as<float>();
}

void AdamW::step(float* params, const float* grads, double lr, int64_t step, size_t first,
                 size_t last) {
  AdamWParams hp{lr, config_.beta1, config_.beta2, config_.eps, 0.0, step};
  last = std::min(last, segments_.size());
  for (size_t i = first; i < last; ++i) {
    const AdamWSegment& s = segments_[i];
    hp.weight_decay = s.decay ? config_.weight_decay : 0.0;
    be_->adamw(params + s.param_offset, grads + s.grad_offset, m_ + s.state_offset,
               v_ + s.state_offset, s.length, hp);
  }
}

void AdamW::step_16(float* master, uint16_t* params, const uint16_t* grads, DType t,
                    float grad_scale, double lr, int64_t step, size_t first, size_t last) {
  AdamWParams hp{lr, config_.beta1, config_.beta2, config_.eps, 0.0, step};
  last = std::min(last, segments_.size());
  for (size_t i = first; i < last; ++i) {
    const AdamWSegment& s = segments_[i];
    hp.weight_decay = s.decay ? config_.weight_decay : 0.0;
    be_->adamw_16(master + s.state_offset, grads + s.grad_offset, grad_scale, m_ + s.state_offset,
                  v_ + s.state_offset, params + s.param_offset, s.length, t, hp);
  }
}

}  // namespace loom
