// The layers of a stage split across a tensor-parallel group (Megatron-LM's
// scheme): vocabulary-parallel embedding and head, attention split by heads,
// MLP split by hidden features; LayerNorms, wpe and the row-parallel biases
// whole on every rank.
#pragma once

#include "loom/nn/factory.h"
#include "loom/parallel/tensor/regions.h"

namespace loom::tp {

class TensorParallelFactory final : public LayerFactory<float> {
 public:
  explicit TensorParallelFactory(Group g) : g_(std::move(g)) {}
  std::unique_ptr<EmbeddingLayer<float>> embedding(ParamLayout& layout,
                                                   const GptConfig& c) const override;
  std::unique_ptr<AttentionLayer<float>> attention(ParamLayout& layout, const std::string& prefix,
                                                   const GptConfig& c,
                                                   float proj_std) const override;
  std::unique_ptr<FeedForward<float>> feed_forward(ParamLayout& layout, const std::string& prefix,
                                                   const GptConfig& c,
                                                   float proj_std) const override;
  std::unique_ptr<HeadLayer<float>> head(ParamLayout& layout, const GptConfig& c) const override;
  bool serial() const override { return false; }

 private:
  Group g_;
};

}  // namespace loom::tp
