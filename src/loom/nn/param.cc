#include "loom/nn/param.h"

#include "loom/core/error.h"

namespace loom {

size_t ParamLayout::add(std::string name, Shape shape, bool decay, float init_std,
                        float init_value) {
  Param p;
  p.name = std::move(name);
  p.shape = shape;
  p.offset = total_;
  p.numel = shape.numel();
  p.decay = decay;
  p.init_std = init_std;
  p.init_value = init_value;
  // Keep every parameter 16-element aligned in the flat buffer (64 bytes in
  // f32), so each view starts on a cache line.
  total_ += (p.numel + 15) / 16 * 16;
  params_.push_back(std::move(p));
  return params_.size() - 1;
}

const Param& ParamLayout::find(const std::string& name) const {
  for (const Param& p : params_)
    if (p.name == name) return p;
  LOOM_FAIL(kInternal, "no parameter named '{}'", name);
}

}  // namespace loom
