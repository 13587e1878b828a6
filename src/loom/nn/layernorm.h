// LayerNorm over the channel dimension, with its weight and bias.
#pragma once

#include <cstdint>
#include <string>

#include "loom/nn/param_store.h"

namespace loom {

template <typename T>
class LayerNorm {
 public:
  // Declares <prefix>.weight (ones) and <prefix>.bias (zeros), both (C).
  LayerNorm(ParamLayout& layout, const std::string& prefix, int64_t C);
  virtual ~LayerNorm() = default;
  ParamId weight, bias;

  // out (N,C), mean and rstd (N) from x (N,C).
  void forward(const ParamStore<T>& ps, T* out, T* mean, T* rstd, const T* x, int64_t N) const;
  // Accumulates dx (N,C) and the parameter gradients from dout (N,C). (A
  // rank holding a slice of the sequence sums the parameter gradients over
  // the group that shares the sequence: parallel/tensor overrides this.)
  virtual void backward(const ParamStore<T>& ps, T* dx, const T* dout, const T* x, const T* mean,
                        const T* rstd, int64_t N) const;

 protected:
  int64_t C_;
};

}  // namespace loom
