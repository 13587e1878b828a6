// The language-model head: final LayerNorm (ln_f), logits through the tied
// token embedding (logits = ln_f(x) @ wte^T over the padded vocabulary), and
// cross-entropy over the real vocabulary.
#pragma once

#include <cstdint>

#include "loom/nn/context.h"
#include "loom/nn/layernorm.h"

namespace loom {

template <typename T>
struct HeadRecord {
  T *lnf, *lnf_mean, *lnf_rstd;  // (B,T,C) (B,T) (B,T)
  T* logits;                     // (B,T,Vp); their gradient after backward
  T *losses, *lse;               // (B,T) each
};

template <typename T>
class Head {
 public:
  // Declares transformer.ln_f.{weight,bias} in the layout's open unit.
  Head(ParamLayout& layout, const GptConfig& c);
  // The LM head reads `wte` (the stage's embedding, or a copy a last stage
  // declares with declare_wte in its own unit, under the same name).
  void tie(ParamId wte) { wte_ = wte; }
  ParamId declare_wte(ParamLayout& layout);
  ParamId wte() const { return wte_; }

  // The logits live in the record, or (recompute_logits) in the stage's
  // shared room, written by forward and again by backward.
  HeadRecord<T> bind(Arena<T>& record, Arena<T>& room, int64_t BT, bool recompute_logits) const;

  void norm_forward(const ParamStore<T>& ps, const HeadRecord<T>& r, const T* x, int64_t BT) const;
  void logits_forward(const ParamStore<T>& ps, const HeadRecord<T>& r, int64_t BT) const;
  // Per-token losses into the record; returns their sum.
  double loss(const HeadRecord<T>& r, const int32_t* targets, int64_t BT) const;
  // d_lnf (BT,C) += the gradient of sum(dloss_n * loss_n) through the logits;
  // the logits are overwritten by their gradient.
  void logits_backward(const ParamStore<T>& ps, const HeadRecord<T>& r, const int32_t* targets,
                       const T* dloss, T* d_lnf, int64_t BT) const;
  // dx (BT,C) += the gradient through ln_f.
  void norm_backward(const ParamStore<T>& ps, const HeadRecord<T>& r, T* dx, const T* d_lnf,
                     const T* x, int64_t BT) const;

  LayerNorm<T> ln_f;

 private:
  GptConfig c_;
  ParamId wte_;
};

}  // namespace loom
