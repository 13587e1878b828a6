// What every layer's forward and backward needs besides its parameters: the
// model's shape, the per-step keys that make dropout reproducible under any
// layout, and a bump allocator that lays records out inside one buffer.
#pragma once

#include <cstdint>
#include <vector>

#include "loom/core/rng.h"
#include "loom/kernels/backend.h"

namespace loom {

struct GptConfig {
  int n_layer = 2;
  int n_embd = 64;
  int n_head = 4;
  int vocab_size = 256;
  int seq_len = 64;
  float dropout = 0.0f;
  // vocab_size rounded up to a multiple of vocab_multiple (128; under tensor
  // parallelism 128 x its size); the extra logits are padding.
  // A multiple of 128 x the tensor-parallel size, so every rank holds an
  // equal vocabulary range.
  int vocab_multiple = 128;
  int padded_vocab() const {
    return (vocab_size + vocab_multiple - 1) / vocab_multiple * vocab_multiple;
  }
  // Mixture of experts (model.moe): num_experts 0 keeps every block's MLP
  // dense; otherwise block i's feed-forward slot is a MoE layer when
  // (i + 1) is a multiple of moe_every (2: blocks 1, 3, 5, ...).
  int moe_experts = 0;
  int moe_top_k = 2;
  int moe_every = 1;
  double moe_capacity_factor = 0;
  double moe_aux_loss_coef = 0.01;
  double moe_z_loss_coef = 0;
  bool moe_bias_balancing = false;  // model.moe.balancing: bias
  double moe_bias_update_rate = 1e-3;
  int moe_router = 0;  // model.moe.router: 0 learned, 1 hash, 2 tag (RouterKind)
  std::vector<int32_t> moe_tag_tokens;
  bool moe_layer(int layer) const { return moe_experts > 0 && (layer + 1) % moe_every == 0; }
};

// GPT-2's initialisation: N(0, 0.02) for matrices and embeddings (the
// residual projections scale it by 1 / sqrt(2 n_layer)).
inline constexpr float kInitStd = 0.02f;

// Per-micro-batch inputs that make dropout reproducible under any layout.
struct StepContext {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t sample0 = 0;  // global index of the micro-batch's first sample
  bool training = true;  // dropout only when training
};

// The rows of a micro-batch of (B, T) that a rank's layers work on: all
// B x T of them, or, under sequence parallelism, the slice [first, first +
// count) of the flattened (B, T) grid (LayerNorms, dropout and residuals run
// on it; the attention and the MLP gather the whole sequence).
//
// Under context parallelism Tn is this rank's share of each sequence (two
// chunks, ContextSplit) and pos (Tn) the global position of each local one,
// which the position embedding, dropout masks and the causal mask use; null:
// the local position is the global one.
struct Rows {
  int64_t B = 0, Tn = 0;
  int64_t first = 0, count = 0;
  const int32_t* pos = nullptr;
  int64_t all() const { return B * Tn; }
  bool split() const { return count != B * Tn; }
  static Rows whole(int64_t B, int64_t Tn) { return Rows{B, Tn, 0, B * Tn}; }
};

// Context parallelism's cut: a sequence of T tokens in 2 x size chunks of
// T / (2 size); rank `rank` holds chunks chunk(0) and chunk(1), in that order
// (balanced: r and 2 size - 1 - r, so every rank has the same causal
// attention work; else 2r and 2r + 1, one contiguous piece).
struct ContextSplit {
  int rank = 0, size = 1;
  bool balanced = true;
  int chunk(int k) const { return balanced ? (k == 0 ? rank : 2 * size - 1 - rank) : 2 * rank + k; }
  // The global position of local position t of a local sequence of Tl tokens.
  int64_t position(int64_t t, int64_t Tl) const {
    const int64_t Tc = Tl / 2;
    return chunk(static_cast<int>(t / Tc)) * Tc + t % Tc;
  }
  std::vector<int32_t> positions(int64_t Tl) const {
    std::vector<int32_t> p(static_cast<size_t>(Tl));
    for (int64_t t = 0; t < Tl; ++t)
      p[static_cast<size_t>(t)] = static_cast<int32_t>(position(t, Tl));
    return p;
  }
};

// Part of a layer's record, in elements from the record's start. A 16-bit
// run keeps records rounded to 16 bits between forward and backward except
// the ranges each layer names (statistics whose rounding backward would
// amplify, values a decision is recomputed from).
struct RecordRange {
  int64_t offset = 0, count = 0;
};

// A block record packed to bf16 (Block::pack) as its layers see it while
// the block runs: the ranges of the record's f32 layout whose values are
// read in bf16 alone, by the attention core's or GELU's 16-bit forms (on a
// backend that fuses them, Backend::fuses_record16) and, on a backend that
// reads bf16 inputs (Backend::reads_inputs16), by a linear's GEMMs, kept
// in the packed slot ("twins": a forward rounds them there, a backward
// reads them there, and pack does not convert them). Unpack does
// not widen them either, but for the shared twins
// (AttentionLayer::shared_twin_ranges), which another kernel of backward
// reads in f32.
struct RecordTwins {
  const float* room = nullptr;     // the record's f32 layout, as the layers address it
  uint16_t* rounded = nullptr;     // the slot's 16-bit part: the elements outside `exact`, in order
  std::vector<RecordRange> exact;  // ranges kept f32 (sorted)
  std::vector<RecordRange> twins;  // ranges read in bf16 (sorted, outside `exact`)
  // The twins whose producer wrote the bf16 values itself (a LayerNorm's
  // output), for the linear that reads them not to round them again: the
  // block's forward runs under one RecordTwins, so these start false.
  mutable std::vector<bool> written;

  // The index in `twins` of [x, x + n), or -1.
  int64_t index_of(const float* x, int64_t n) const {
    if (x < room) return -1;
    const int64_t at = x - room;
    for (size_t k = 0; k < twins.size(); ++k)
      if (twins[k].offset == at && twins[k].count == n) return static_cast<int64_t>(k);
    return -1;
  }
  // The bf16 home of [x, x + n) when that is one of `twins`; else null.
  uint16_t* find(const float* x, int64_t n) const {
    if (index_of(x, n) < 0) return nullptr;
    const int64_t at = x - room;
    int64_t before = 0;  // exact elements ahead of `at`
    for (const RecordRange& r : exact)
      if (r.offset < at) before += r.count;
    return rounded + (at - before);
  }
  void mark_written(const float* x, int64_t n) const {
    const int64_t k = index_of(x, n);
    if (k < 0) return;
    written.resize(twins.size(), false);
    written[static_cast<size_t>(k)] = true;
  }
  bool is_written(const float* x, int64_t n) const {
    const int64_t k = index_of(x, n);
    return k >= 0 && static_cast<size_t>(k) < written.size() && written[static_cast<size_t>(k)];
  }
};

// The dropout stream of one micro-batch: masks are keyed on (seed, step,
// global sample, site), so a recomputed forward draws the same masks.
struct Dropout {
  Dropout(const StepContext& ctx, float p)
      : stream(ctx.seed, ctx.step, ctx.training ? p : 0.0f), sample0(ctx.sample0) {}
  DropoutSpec at(int layer, DropoutSite site) const {
    return DropoutSpec{&stream, sample0, dropout_site(layer, site)};
  }
  // x (rows.count, C) *= the masks its rows have in one process.
  template <typename T>
  void apply(const Backend<T>& be, T* x, int layer, DropoutSite site, const Rows& rows,
             int64_t C) const {
    DropoutSpec spec = at(layer, site);
    spec.positions = rows.pos;
    be.dropout(x, spec, rows.Tn, C, rows.first, rows.count);
  }
  // out (rows.count, C) = x * those masks + residual (null: none), one pass.
  template <typename T>
  void apply_add(const Backend<T>& be, T* out, const T* x, const T* residual, int layer,
                 DropoutSite site, const Rows& rows, int64_t C) const {
    DropoutSpec spec = at(layer, site);
    spec.positions = rows.pos;
    be.dropout_residual(out, x, residual, spec, rows.Tn, C, rows.first, rows.count);
  }
  DropoutStream stream;
  uint64_t sample0;
};

// Hands out consecutive ranges of a buffer; with a null base it only counts,
// so the same code sizes a record and lays it out.
template <typename T>
class Arena {
 public:
  explicit Arena(T* base = nullptr) : base_(base) {}
  T* take(int64_t n) {
    T* r = base_ ? base_ + used_ : nullptr;
    used_ += n;
    return r;
  }
  int64_t used() const { return used_; }

 private:
  T* base_;
  int64_t used_ = 0;
};

}  // namespace loom
