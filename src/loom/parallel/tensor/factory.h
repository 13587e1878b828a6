// The layers of a stage split across a tensor-parallel group (Megatron-LM's
// scheme): vocabulary-parallel embedding and head, attention split by heads,
// MLP split by hidden features; LayerNorms, wpe and the row-parallel biases
// whole on every rank; with sequence parallelism the LayerNorms, dropout
// and residuals work on this rank's slice of the sequence.
#pragma once

#include "loom/nn/factory.h"
#include "loom/parallel/tensor/regions.h"

namespace loom::tp {

class TensorParallelFactory final : public LayerFactory<float> {
 public:
  // sequence_parallel: LayerNorms, dropout and residuals on this rank's
  // slice of the sequence (parallel.sequence_parallel). moe_split: each
  // rank routes and runs the MoE layers' experts for its share of a
  // micro-batch's sequences, which must divide by the group's size (the
  // caller sums the router's and experts' gradients over the group:
  // StepEngine::sum_split_moe_grads); else every rank runs all of them.
  TensorParallelFactory(Group g, bool sequence_parallel, bool moe_split = false)
      : g_(std::move(g)), sp_(sequence_parallel), moe_split_(moe_split) {}
  std::unique_ptr<EmbeddingLayer<float>> embedding(ParamLayout& layout,
                                                   const GptConfig& c) const override;
  std::unique_ptr<AttentionLayer<float>> attention(ParamLayout& layout, const std::string& prefix,
                                                   const GptConfig& c,
                                                   float proj_std) const override;
  std::unique_ptr<FeedForward<float>> feed_forward(ParamLayout& layout, const std::string& prefix,
                                                   const GptConfig& c, float proj_std,
                                                   int layer) const override;
  std::unique_ptr<LayerNorm<float>> layer_norm(ParamLayout& layout, const std::string& prefix,
                                               int64_t C) const override;
  std::unique_ptr<HeadLayer<float>> head(ParamLayout& layout, const GptConfig& c) const override;
  bool serial() const override { return false; }
  std::pair<int, int> sequence_split() const override {
    return sp_ ? std::pair{g_.rank(), g_.size()} : std::pair{0, 1};
  }

 private:
  Group g_;
  bool sp_;
  bool moe_split_;
};

}  // namespace loom::tp
