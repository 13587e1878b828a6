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
// A 16-bit run keeps a kNone or kSelective record packed: the block's
// output in f32 (the next block's input, the residual stream), the ranges
// the layers name as exact in f32, and the rest rounded to 16 bits. Forward
// computes the record in the stage's room and packs it; backward widens it
// back into the room.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/core/dtype.h"
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

  // A packed record (mode kNone or kSelective; `t` kBF16 or kF16), in
  // elements of T: the output, the exact ranges, the rest at 2 bytes.
  int64_t packed_elems(const Rows& rows, Recompute mode) const;
  // `whole` holds a record bound with `mode` over contiguous memory (bind's
  // `record` arena), all but its output, which forward wrote into the
  // slot's first rows.count x C elements; pack fills the rest of `slot`.
  // `skip`: ranges of `whole` (sorted, outside the exact ones) not rounded,
  // whose 16-bit values forward already wrote into the slot (twins).
  void pack(const Backend<T>& be, const T* whole, T* slot, const Rows& rows, Recompute mode,
            DType t, const std::vector<RecordRange>& skip = {}) const;
  // The inverse, but for the output (backward does not read it): exact
  // ranges copied, the rest widened but `skip` (ranges backward reads in
  // 16 bits alone).
  void unpack(const Backend<T>& be, const T* slot, T* whole, const Rows& rows, Recompute mode,
              DType t, const std::vector<RecordRange>& skip = {}) const;
  // The exact ranges of a record bound with `mode`, in order: the
  // LayerNorms' statistics and the slots' own (the output aside).
  std::vector<RecordRange> exact_ranges(const Rows& rows, Recompute mode) const;
  // The ranges of such a record read in bf16, in order (RecordTwins): the
  // layers' own, read by their 16-bit kernel forms (q|k|v by the attention
  // core's, GELU's input by GELU's); with linears16 (a backend whose GEMMs
  // read bf16 inputs) also those the linears' GEMMs alone read (the
  // LayerNorms' outputs where the layer after takes them to its linears
  // alone, GELU's output), and, with `shared`, the layers' shared twins
  // (read in f32 by another kernel too, so unpack widens them: the ranges
  // unpack leaves are those without).
  std::vector<RecordRange> twin_ranges(const Rows& rows, Recompute mode, bool linears16,
                                       bool shared = true) const;
  // Where a packed slot's 16-bit part begins.
  uint16_t* rounded_part(T* slot, const Rows& rows, Recompute mode) const;

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
