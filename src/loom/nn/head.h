// The language-model head: final LayerNorm (ln_f), logits through the tied
// token embedding (logits = ln_f(x) @ wte^T over the padded vocabulary), and
// cross-entropy over the real vocabulary. HeadLayer is the stage's head
// slot: Head fills it in one process, parallel/tensor's VocabParallelHead
// with the vocabulary split across the tensor-parallel group (no rank forms
// the full logits).
#pragma once

#include <cstdint>
#include <memory>

#include "loom/nn/context.h"
#include "loom/nn/layernorm.h"

namespace loom {

template <typename T>
struct HeadRecord {
  T *lnf, *lnf_mean, *lnf_rstd;  // (rows,C) (rows) (rows): this rank's rows
  T* lnf_all;                    // (B,T,C) ln_f's output, gathered when the sequence is split
  T* logits;        // (B,T,V) over this rank's vocabulary; their gradient after backward
  T *losses, *lse;  // (B,T) each
};

template <typename T>
class HeadLayer {
 public:
  // ln_f: transformer.ln_f, declared by the caller in the head's unit.
  explicit HeadLayer(std::unique_ptr<LayerNorm<T>> ln) : ln_f(std::move(ln)) {}
  virtual ~HeadLayer() = default;
  // The LM head reads `wte` (the stage's embedding, or a copy a last stage
  // declares with declare_wte in its own unit, under the same name).
  void tie(ParamId wte) { wte_ = wte; }
  virtual ParamId declare_wte(ParamLayout& layout) = 0;
  ParamId wte() const { return wte_; }

  // The logits live in the record, or (recompute_logits) in the stage's
  // shared room, written by forward and again by backward.
  virtual HeadRecord<T> bind(Arena<T>& record, Arena<T>& room, const Rows& rows,
                             bool recompute_logits) const = 0;
  // ln_f on this rank's rows x (rows.count, C).
  void norm_forward(const ParamStore<T>& ps, const HeadRecord<T>& r, const T* x,
                    const Rows& rows) const {
    ln_f->forward(ps, r.lnf, r.lnf_mean, r.lnf_rstd, x, rows.count);
  }
  // The logits of every row of the micro-batch (gathering ln_f's output when
  // the sequence is split).
  virtual void logits_forward(const ParamStore<T>& ps, const HeadRecord<T>& r,
                              const Rows& rows) const = 0;
  // Per-token losses of every row into the record; returns their sum.
  virtual double loss(const ParamStore<T>& ps, const HeadRecord<T>& r, const int32_t* targets,
                      const Rows& rows) const = 0;
  // d_lnf (rows.count, C) += the gradient of sum(dloss_n * loss_n) through
  // the logits (dloss for every row); the logits' buffer may become their
  // gradient (its values are not read after).
  virtual void logits_backward(const ParamStore<T>& ps, const HeadRecord<T>& r,
                               const int32_t* targets, const T* dloss, T* d_lnf,
                               const Rows& rows) const = 0;
  // dx (rows.count, C) += the gradient through ln_f.
  void norm_backward(const ParamStore<T>& ps, const HeadRecord<T>& r, T* dx, const T* d_lnf,
                     const T* x, const Rows& rows) const {
    ln_f->backward(ps, dx, d_lnf, x, r.lnf_mean, r.lnf_rstd, rows.count);
  }

  std::unique_ptr<LayerNorm<T>> ln_f;

 protected:
  ParamId wte_;
};

template <typename T>
class Head final : public HeadLayer<T> {
 public:
  Head(std::unique_ptr<LayerNorm<T>> ln, const GptConfig& c) : HeadLayer<T>(std::move(ln)), c_(c) {}
  ParamId declare_wte(ParamLayout& layout) override;
  HeadRecord<T> bind(Arena<T>& record, Arena<T>& room, const Rows& rows,
                     bool recompute_logits) const override;
  void logits_forward(const ParamStore<T>& ps, const HeadRecord<T>& r,
                      const Rows& rows) const override;
  double loss(const ParamStore<T>& ps, const HeadRecord<T>& r, const int32_t* targets,
              const Rows& rows) const override;
  void logits_backward(const ParamStore<T>& ps, const HeadRecord<T>& r, const int32_t* targets,
                       const T* dloss, T* d_lnf, const Rows& rows) const override;

 private:
  GptConfig c_;
};

}  // namespace loom
