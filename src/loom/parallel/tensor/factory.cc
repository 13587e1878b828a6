#include "loom/parallel/tensor/factory.h"

#include "loom/parallel/tensor/parallel_layers.h"
#include "loom/parallel/tensor/vocab_parallel.h"

namespace loom::tp {

std::unique_ptr<EmbeddingLayer<float>> TensorParallelFactory::embedding(ParamLayout& layout,
                                                                        const GptConfig& c) const {
  return std::make_unique<VocabParallelEmbedding>(layout, c, g_);
}

std::unique_ptr<AttentionLayer<float>> TensorParallelFactory::attention(ParamLayout& layout,
                                                                        const std::string& prefix,
                                                                        const GptConfig& c,
                                                                        float proj_std) const {
  return std::make_unique<ParallelAttention>(layout, prefix, c, proj_std, g_);
}

std::unique_ptr<FeedForward<float>> TensorParallelFactory::feed_forward(ParamLayout& layout,
                                                                        const std::string& prefix,
                                                                        const GptConfig& c,
                                                                        float proj_std) const {
  return std::make_unique<ParallelMlp>(layout, prefix, c.n_embd, proj_std, g_);
}

std::unique_ptr<LayerNorm<float>> TensorParallelFactory::layer_norm(ParamLayout& layout,
                                                                    const std::string& prefix,
                                                                    int64_t C) const {
  if (sp_) return std::make_unique<SequenceParallelLayerNorm>(layout, prefix, C, g_);
  return std::make_unique<LayerNorm<float>>(layout, prefix, C);
}

std::unique_ptr<HeadLayer<float>> TensorParallelFactory::head(ParamLayout& layout,
                                                              const GptConfig& c) const {
  return std::make_unique<VocabParallelHead>(layer_norm(layout, "transformer.ln_f", c.n_embd), c,
                                             g_);
}

}  // namespace loom::tp
