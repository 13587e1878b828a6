// Token + position embedding (GPT-2's wte and wpe), with dropout on the sum.
// EmbeddingLayer is the stage's embedding slot: Embedding fills it in one
// process, parallel/tensor's VocabParallelEmbedding with wte's rows split
// across the tensor-parallel group.
#pragma once

#include <cstdint>

#include "loom/nn/context.h"
#include "loom/nn/param_store.h"

namespace loom {

template <typename T>
class EmbeddingLayer {
 public:
  virtual ~EmbeddingLayer() = default;
  virtual ParamId wte() const = 0;
  virtual ParamId wpe() const = 0;
  // out (rows.count, C) = dropout(wte[tokens] + wpe[t]) for this rank's
  // rows of the micro-batch; tokens (B,T) are the whole micro-batch's.
  virtual void forward(const ParamStore<T>& ps, T* out, const int32_t* tokens, const Rows& rows,
                       const Dropout& drop) const = 0;
  // dout (rows.count, C) is the gradient of out; dropout is undone in place
  // on it, then accumulated into the gradients of wte and wpe.
  virtual void backward(const ParamStore<T>& ps, T* dout, const int32_t* tokens, const Rows& rows,
                        const Dropout& drop) const = 0;
};

template <typename T>
class Embedding final : public EmbeddingLayer<T> {
 public:
  // Declares transformer.wte.weight (padded vocabulary x C) and
  // transformer.wpe.weight (seq_len x C) in the layout's open unit.
  Embedding(ParamLayout& layout, const GptConfig& c);
  ParamId wte() const override { return wte_; }
  ParamId wpe() const override { return wpe_; }
  void forward(const ParamStore<T>& ps, T* out, const int32_t* tokens, const Rows& rows,
               const Dropout& drop) const override;
  void backward(const ParamStore<T>& ps, T* dout, const int32_t* tokens, const Rows& rows,
                const Dropout& drop) const override;

 private:
  ParamId wte_, wpe_;
  int64_t C_, V_;  // V_: the rows of wte (the padded vocabulary)
};

}  // namespace loom
