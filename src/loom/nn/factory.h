// What fills each slot of a stage: the embedding, every block's attention and
// feed-forward, and the head. The default fills them with the single-process
// layers of nn/; parallel/tensor's factory with their tensor-parallel
// counterparts, so the stage never depends on how a layer is split.
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "loom/nn/attention.h"
#include "loom/nn/embedding.h"
#include "loom/nn/head.h"
#include "loom/nn/layernorm.h"
#include "loom/nn/mlp.h"
#include "loom/nn/moe.h"

namespace loom {

template <typename T>
class LayerFactory {
 public:
  virtual ~LayerFactory() = default;
  virtual std::unique_ptr<EmbeddingLayer<T>> embedding(ParamLayout& layout,
                                                       const GptConfig& c) const {
    return std::make_unique<Embedding<T>>(layout, c);
  }
  virtual std::unique_ptr<AttentionLayer<T>> attention(ParamLayout& layout,
                                                       const std::string& prefix,
                                                       const GptConfig& c, float proj_std) const {
    return std::make_unique<Attention<T>>(layout, prefix, c, proj_std, core_);
  }
  // Block `layer`'s: the MLP, or a mixture of experts (c.moe_layer).
  virtual std::unique_ptr<FeedForward<T>> feed_forward(ParamLayout& layout,
                                                       const std::string& prefix,
                                                       const GptConfig& c, float proj_std,
                                                       int layer) const {
    if (c.moe_layer(layer)) {
      MoeConfig m;
      m.router = RouterConfig{c.moe_experts, c.moe_top_k, c.moe_capacity_factor,
                              static_cast<RouterKind>(c.moe_router), c.moe_tag_tokens};
      m.aux_loss_coef = c.moe_aux_loss_coef;
      m.z_loss_coef = c.moe_z_loss_coef;
      m.bias_balancing = c.moe_bias_balancing;
      m.bias_update_rate = c.moe_bias_update_rate;
      auto layer = std::make_unique<MoeLayer<T>>(layout, prefix, c.n_embd, proj_std, m, experts_);
      if (sequences_) layer->set_sequence_gather(sequences_);
      return layer;
    }
    return std::make_unique<Mlp<T>>(layout, prefix, c.n_embd, proj_std);
  }
  virtual std::unique_ptr<LayerNorm<T>> layer_norm(ParamLayout& layout, const std::string& prefix,
                                                   int64_t C) const {
    return std::make_unique<LayerNorm<T>>(layout, prefix, C);
  }
  // The head, its ln_f (transformer.ln_f) declared in the layout's open unit.
  virtual std::unique_ptr<HeadLayer<T>> head(ParamLayout& layout, const GptConfig& c) const {
    return std::make_unique<Head<T>>(layer_norm(layout, "transformer.ln_f", c.n_embd), c);
  }
  // How the layers split a micro-batch's rows (flattened (B, T)) across
  // ranks: this rank's piece and the number of pieces (sequence parallelism);
  // {0, 1}: every rank works on all rows.
  virtual std::pair<int, int> sequence_split() const { return {0, 1}; }
  // How a micro-batch's sequences split across the context-parallel group
  // (this rank's two chunks); {0, 1}: whole sequences here.
  ContextSplit context_split() const { return context_; }
  // Whether the layers are the single-process ones with every expert here
  // (KV-cache decoding reads their weights directly).
  virtual bool serial() const { return experts_ == nullptr && core_ == nullptr; }
  static const LayerFactory<T>& single_process() {
    static const LayerFactory<T> f;
    return f;
  }
  // Expert parallelism: the MoE layers' experts split over the
  // dispatcher's group (null: every expert on every rank).
  void set_expert_dispatcher(std::shared_ptr<ExpertDispatcher<T>> d) { experts_ = std::move(d); }
  // Context parallelism: every attention layer runs `core`, each sequence
  // split as `split` says.
  void set_attention_core(std::shared_ptr<const AttentionCore<T>> core, ContextSplit split,
                          std::shared_ptr<SequenceGather<T>> sequences) {
    core_ = std::move(core), context_ = split, sequences_ = std::move(sequences);
  }

 protected:
  std::shared_ptr<ExpertDispatcher<T>> experts_;
  std::shared_ptr<const AttentionCore<T>> core_;
  ContextSplit context_;
  std::shared_ptr<SequenceGather<T>> sequences_;  // MoE layers' routing over the whole sequences
};

}  // namespace loom
