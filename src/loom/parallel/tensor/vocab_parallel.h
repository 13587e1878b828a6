// The embedding and the LM head with the vocabulary split across the
// tensor-parallel group: rank r holds rows [r Vp/tp, (r+1) Vp/tp) of wte
// (ShardSpec::vocab), the padded vocabulary being a multiple of 128 x tp.
//
//   VocabParallelEmbedding  each rank looks up the tokens in its range (the
//                           others contribute zero), the rows are summed over
//                           the group (exact: one term is non-zero), then the
//                           position embedding (whole) is added.
//   VocabParallelHead       each rank computes the logits of its range only;
//                           the cross-entropy reduces the row maxima, the sums
//                           of exponentials and the target logits over the
//                           group, so no rank forms the full logits. The
//                           gradient of ln_f's output is summed over the
//                           group (the copy-to region the head opens).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "loom/nn/embedding.h"
#include "loom/nn/head.h"
#include "loom/parallel/tensor/regions.h"

namespace loom::tp {

class VocabParallelEmbedding final : public EmbeddingLayer<float> {
 public:
  VocabParallelEmbedding(ParamLayout& layout, const GptConfig& c, const Group& g);
  ParamId wte() const override { return wte_; }
  ParamId wpe() const override { return wpe_; }
  // With the sequence split, the looked-up rows are reduce-scattered to
  // this rank's rows instead of all-reduced, and backward gathers them.
  void forward(const ParamStore<float>& ps, float* out, const int32_t* tokens, const Rows& rows,
               const Dropout& drop) const override;
  void backward(const ParamStore<float>& ps, float* dout, const int32_t* tokens, const Rows& rows,
                const Dropout& drop) const override;

 private:
  Group g_;
  int64_t C_, v0_, v1_;  // this rank's rows [v0, v1) of the padded vocabulary
  ParamId wte_, wpe_;
};

class VocabParallelHead final : public HeadLayer<float> {
 public:
  // With the sequence split, ln_f runs on this rank's rows, its output is
  // gathered for the logits, and the gradient back to it reduce-scattered.
  VocabParallelHead(std::unique_ptr<LayerNorm<float>> ln, const GptConfig& c, const Group& g);
  ParamId declare_wte(ParamLayout& layout) override;
  HeadRecord<float> bind(Arena<float>& record, Arena<float>& room, const Rows& rows,
                         bool recompute_logits) const override;
  void logits_forward(const ParamStore<float>& ps, const HeadRecord<float>& r,
                      const Rows& rows) const override;
  double loss(const ParamStore<float>& ps, const HeadRecord<float>& r, const int32_t* targets,
              const Rows& rows) const override;
  void logits_backward(const ParamStore<float>& ps, const HeadRecord<float>& r,
                       const int32_t* targets, const float* dloss, float* d_lnf,
                       const Rows& rows) const override;

 private:
  Group g_;
  GptConfig c_;
  int64_t Vl_, v0_;  // this rank's vocabulary columns [v0, v0 + Vl)
};

// A LayerNorm on this rank's rows of a split sequence: its parameter
// gradients are partial sums over the rows, so backward adds them up over the
// group before accumulating (Megatron-LM's sequence-parallel LayerNorm).
class SequenceParallelLayerNorm final : public LayerNorm<float> {
 public:
  SequenceParallelLayerNorm(ParamLayout& layout, const std::string& prefix, int64_t C,
                            const Group& g)
      : LayerNorm<float>(layout, prefix, C), g_(g) {}
  void backward(const ParamStore<float>& ps, float* dx, const float* dout, const float* x,
                const float* mean, const float* rstd, int64_t N) const override;

 private:
  Group g_;
};

}  // namespace loom::tp
