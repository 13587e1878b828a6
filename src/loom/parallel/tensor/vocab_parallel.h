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

#include "loom/nn/embedding.h"
#include "loom/nn/head.h"
#include "loom/parallel/tensor/regions.h"

namespace loom::tp {

class VocabParallelEmbedding final : public EmbeddingLayer<float> {
 public:
  VocabParallelEmbedding(ParamLayout& layout, const GptConfig& c, const Group& g);
  ParamId wte() const override { return wte_; }
  ParamId wpe() const override { return wpe_; }
  void forward(const ParamStore<float>& ps, float* out, const int32_t* tokens, int64_t B,
               int64_t Tn, const Dropout& drop) const override;
  void backward(const ParamStore<float>& ps, float* dout, const int32_t* tokens, int64_t B,
                int64_t Tn, const Dropout& drop) const override;

 private:
  Group g_;
  int64_t C_, v0_, v1_;  // this rank's rows [v0, v1) of the padded vocabulary
  ParamId wte_, wpe_;
};

class VocabParallelHead final : public HeadLayer<float> {
 public:
  VocabParallelHead(ParamLayout& layout, const GptConfig& c, const Group& g);
  ParamId declare_wte(ParamLayout& layout) override;
  HeadRecord<float> bind(Arena<float>& record, Arena<float>& room, int64_t BT,
                         bool recompute_logits) const override;
  void logits_forward(const ParamStore<float>& ps, const HeadRecord<float>& r,
                      int64_t BT) const override;
  double loss(const HeadRecord<float>& r, const int32_t* targets, int64_t BT) const override;
  void logits_backward(const ParamStore<float>& ps, const HeadRecord<float>& r,
                       const int32_t* targets, const float* dloss, float* d_lnf,
                       int64_t BT) const override;

 private:
  Group g_;
  GptConfig c_;
  int64_t Vl_, v0_;  // this rank's vocabulary columns [v0, v0 + Vl)
};

}  // namespace loom::tp
