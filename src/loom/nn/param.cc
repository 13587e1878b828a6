#include "loom/nn/param.h"

#include "loom/core/error.h"

namespace loom {

void ParamLayout::begin_unit(std::string name) {
  // A unit starts after the previous one's padding.
  next_ = total_;
  units_.push_back({std::move(name), next_, next_});
}

size_t ParamLayout::add(std::string name, Shape shape, bool decay, float init_std,
                        float init_value) {
  LOOM_CHECK(!units_.empty(), "parameter '{}' added before any unit", name);
  Param p;
  p.unit = static_cast<int>(units_.size()) - 1;
  p.name = std::move(name);
  p.shape = shape;
  p.offset = next_;
  p.numel = shape.numel();
  p.decay = decay;
  p.init_std = init_std;
  p.init_value = init_value;
  // Keep every parameter 16-element aligned in the flat buffer (64 bytes in
  // f32), so each view starts on a cache line.
  next_ += (p.numel + 15) / 16 * 16;
  // The open unit ends padded to unit_multiple_.
  Unit& u = units_.back();
  u.end = u.begin + (next_ - u.begin + unit_multiple_ - 1) / unit_multiple_ * unit_multiple_;
  total_ = u.end;
  params_.push_back(std::move(p));
  return params_.size() - 1;
}

int64_t ParamLayout::numel() const {
  int64_t n = 0;
  for (const Param& p : params_) n += p.numel;
  return n;
}

const Param& ParamLayout::find(const std::string& name) const {
  for (const Param& p : params_)
    if (p.name == name) return p;
  LOOM_FAIL(kInternal, "no parameter named '{}'", name);
}

}  // namespace loom
