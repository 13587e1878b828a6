// Token + position embedding (GPT-2's wte and wpe), with dropout on the sum.
#pragma once

#include <cstdint>

#include "loom/nn/context.h"
#include "loom/nn/param_store.h"

namespace loom {

template <typename T>
class Embedding {
 public:
  // Declares transformer.wte.weight (padded vocabulary x C) and
  // transformer.wpe.weight (seq_len x C) in the layout's open unit.
  Embedding(ParamLayout& layout, const GptConfig& c);
  ParamId wte, wpe;

  // out (B,T,C) = dropout(wte[tokens] + wpe[0..T)).
  void forward(const ParamStore<T>& ps, T* out, const int32_t* tokens, int64_t B, int64_t Tn,
               const Dropout& drop) const;
  // dout (B,T,C) is the gradient of out; dropout is undone in place on it,
  // then accumulated into the gradients of wte and wpe.
  void backward(const ParamStore<T>& ps, T* dout, const int32_t* tokens, int64_t B, int64_t Tn,
                const Dropout& drop) const;

 private:
  int64_t C_;
};

}  // namespace loom
