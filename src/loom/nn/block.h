// A pre-LayerNorm transformer block:
//   res2 = x + dropout(attn(ln_1(x)))
//   res3 = res2 + dropout(ffn(ln_2(res2)))
// with the feed-forward slot filled by an MLP (or, later, a mixture of
// experts). Parameters are named transformer.h.<global layer>.*.
//
// What a block keeps for backward depends on its recomputation:
//   kNone       everything its backward reads;
//   kSelective  all but what is large and cheap to recompute (the attention
//               core's output and log-sum-exp, the GELU output), which sits
//               in the stage's shared recompute room and is recomputed;
//   kFull       only its output; the stage runs the block's forward again
//               (into the shared room) just before its backward.
#pragma once

#include <cstdint>
#include <memory>

#include "loom/nn/context.h"
#include "loom/nn/factory.h"
#include "loom/nn/layernorm.h"

namespace loom {

enum class Recompute { kNone, kSelective, kFull };

template <typename T>
struct BlockRecord {
  // Rows are this rank's rows of the micro-batch (all of them unless the
  // sequence is split).
  T *ln1, *ln1_mean, *ln1_rstd;  // (rows,C) (rows) (rows)
  T* attn;                       // the attention slot's record
  T* attn_recompute;             // its part in the shared room (selective)
  T* res2;                       // (B,T,C) residual after attention
  T *ln2, *ln2_mean, *ln2_rstd;  // (B,T,C) (B,T) (B,T)
  T* ffn;                        // the feed-forward slot's record
  T* ffn_recompute;              // its part in the shared room (selective)
  T* res3;                       // (B,T,C) block output
};

template <typename T>
class Block {
 public:
  // Declares the block's parameters (layer = global index) in the layout's
  // open unit; the attention and feed-forward slots come from `f`.
  Block(ParamLayout& layout, const GptConfig& c, int layer,
        const LayerFactory<T>& f = LayerFactory<T>::single_process());

  int layer() const { return layer_; }
  // Lays a record out over `record` (the micro-batch's store) and `recompute`
  // (the stage's shared room); null bases only count.
  BlockRecord<T> bind(Arena<T>& record, Arena<T>& recompute, const Rows& rows,
                      Recompute mode) const;
  int64_t record_elems(const Rows& rows, Recompute mode) const;
  int64_t recompute_elems(const Rows& rows, Recompute mode) const;
  int64_t scratch_elems(const Rows& rows) const;

  // Fills r (bound with kNone or kSelective) from x (rows.count, C); r.res3 is the
  // output. record_only: a recomputation for backward, which reads the
  // record but not the output, so the feed-forward's last projection and
  // the second residual are skipped (a third of the block's GEMM work).
  void forward(const ParamStore<T>& ps, const BlockRecord<T>& r, const T* x, const Rows& rows,
               bool selective, const Dropout& drop, bool record_only = false) const;
  // dresid (rows.count, C): the gradient of the output in, of the input x out.
  void backward(const ParamStore<T>& ps, const BlockRecord<T>& r, const T* x, T* dresid,
                const Rows& rows, bool selective, const Dropout& drop, T* scratch) const;

  std::unique_ptr<LayerNorm<T>> ln_1;
  std::unique_ptr<AttentionLayer<T>> attn;
  std::unique_ptr<LayerNorm<T>> ln_2;
  std::unique_ptr<FeedForward<T>> ffn;

 private:
  int layer_;
  int64_t C_;
};

}  // namespace loom
