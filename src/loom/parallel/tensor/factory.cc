#include "loom/parallel/tensor/factory.h"

#include "loom/core/error.h"
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
  return std::make_unique<ParallelAttention>(layout, prefix, c, proj_std, g_, core_);
}

namespace {

// A MoE layer's rows gathered over the tensor-parallel group.
class RowGather final : public RowSplit<float> {
 public:
  explicit RowGather(Group g) : g_(std::move(g)) {}
  int rank() const override { return g_.rank(); }
  int ranks() const override { return g_.size(); }
  void gather(const float* mine, int64_t n, float* all) override { g_.gather(mine, all, n); }

 private:
  Group g_;
};

}  // namespace

std::unique_ptr<FeedForward<float>> TensorParallelFactory::feed_forward(ParamLayout& layout,
                                                                        const std::string& prefix,
                                                                        const GptConfig& c,
                                                                        float proj_std,
                                                                        int layer) const {
  if (c.moe_layer(layer)) {
    LOOM_CHECK_KIND(kUnsupported, !sp_,
                    "{}: mixture-of-experts layers do not run under sequence parallelism yet",
                    prefix);
    // The router and the experts whole on every rank of the group (experts
    // are not split by tensor parallelism; expert parallelism splits
    // them); with moe_split each rank takes its share of the sequences.
    std::unique_ptr<FeedForward<float>> f =
        LayerFactory<float>::feed_forward(layout, prefix, c, proj_std, layer);
    if (moe_split_)
      static_cast<MoeLayer<float>&>(*f).set_row_split(std::make_shared<RowGather>(g_));
    return f;
  }
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
