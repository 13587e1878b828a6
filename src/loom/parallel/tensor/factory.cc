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

std::unique_ptr<HeadLayer<float>> TensorParallelFactory::head(ParamLayout& layout,
                                                              const GptConfig& c) const {
  return std::make_unique<VocabParallelHead>(layout, c, g_);
}

}  // namespace loom::tp
