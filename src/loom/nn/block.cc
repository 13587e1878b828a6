#include "loom/nn/block.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace loom {

namespace {

// Residual projections get 0.02 / sqrt(2 n_layer), as GPT-2 does, so the
// residual stream's variance does not grow with depth.
float proj_std(const GptConfig& c) {
  return kInitStd / std::sqrt(2.0f * static_cast<float>(c.n_layer));
}

std::string prefix(int layer) {
  return "transformer.h." + std::to_string(layer);
}

}  // namespace

template <typename T>
Block<T>::Block(ParamLayout& layout, const GptConfig& c, int layer, const LayerFactory<T>& f)
    : ln_1(layout, prefix(layer) + ".ln_1", c.n_embd),
      attn(f.attention(layout, prefix(layer) + ".attn", c, proj_std(c))),
      ln_2(layout, prefix(layer) + ".ln_2", c.n_embd),
      ffn(f.feed_forward(layout, prefix(layer) + ".mlp", c, proj_std(c))),
      layer_(layer),
      C_(c.n_embd) {}

template <typename T>
BlockRecord<T> Block<T>::bind(Arena<T>& rec, Arena<T>& room, int64_t B, int64_t Tn,
                              Recompute mode) const {
  const int64_t BT = B * Tn, C = C_;
  BlockRecord<T> r{};
  if (mode == Recompute::kFull) {
    r.res3 = rec.take(BT * C);
    return r;
  }
  const bool sel = mode == Recompute::kSelective;
  r.ln1 = rec.take(BT * C), r.ln1_mean = rec.take(BT), r.ln1_rstd = rec.take(BT);
  r.attn = rec.take(attn->record_elems(B, Tn, sel));
  r.attn_recompute = room.take(attn->recompute_elems(B, Tn, sel));
  r.res2 = rec.take(BT * C);
  r.ln2 = rec.take(BT * C), r.ln2_mean = rec.take(BT), r.ln2_rstd = rec.take(BT);
  r.ffn = rec.take(ffn->record_elems(BT, sel));
  r.ffn_recompute = room.take(ffn->recompute_elems(BT, sel));
  r.res3 = rec.take(BT * C);
  return r;
}

template <typename T>
int64_t Block<T>::record_elems(int64_t B, int64_t Tn, Recompute mode) const {
  Arena<T> rec, room;
  bind(rec, room, B, Tn, mode);
  return rec.used();
}

template <typename T>
int64_t Block<T>::recompute_elems(int64_t B, int64_t Tn, Recompute mode) const {
  Arena<T> rec, room;
  // Full: the whole record is rebuilt in the room before backward.
  bind(rec, room, B, Tn, mode == Recompute::kFull ? Recompute::kNone : mode);
  return mode == Recompute::kFull ? rec.used() : room.used();
}

template <typename T>
int64_t Block<T>::scratch_elems(int64_t B, int64_t Tn) const {
  const int64_t BT = B * Tn;
  // d_proj and d_ln, then the attention's or the feed-forward's own (used
  // one after the other, so they share).
  return 2 * BT * C_ + std::max(attn->scratch_elems(B, Tn), ffn->scratch_elems(BT));
}

template <typename T>
void Block<T>::forward(const ParamStore<T>& ps, const BlockRecord<T>& r, const T* x, int64_t B,
                       int64_t Tn, bool selective, const Dropout& drop, bool record_only) const {
  const int64_t BT = B * Tn, C = C_;
  ln_1.forward(ps, r.ln1, r.ln1_mean, r.ln1_rstd, x, BT);
  attn->forward(ps, r.attn, selective, r.res2, r.ln1, B, Tn,
                drop.at(layer_, DropoutSite::kAttnProbs), r.attn_recompute);
  cpu::dropout_inplace(r.res2, drop.at(layer_, DropoutSite::kAttnResid), B, Tn, C);
  cpu::add_inplace(r.res2, x, BT * C);
  ln_2.forward(ps, r.ln2, r.ln2_mean, r.ln2_rstd, r.res2, BT);
  ffn->forward(ps, r.ffn, selective, record_only ? nullptr : r.res3, r.ln2, BT, r.ffn_recompute);
  if (record_only) return;
  cpu::dropout_inplace(r.res3, drop.at(layer_, DropoutSite::kMlpResid), B, Tn, C);
  cpu::add_inplace(r.res3, r.res2, BT * C);
}

template <typename T>
void Block<T>::backward(const ParamStore<T>& ps, const BlockRecord<T>& r, const T* x, T* dresid,
                        int64_t B, int64_t Tn, bool selective, const Dropout& drop,
                        T* scratch) const {
  const int64_t BT = B * Tn, C = C_;
  const size_t bytes = static_cast<size_t>(BT * C) * sizeof(T);
  T* d_proj = scratch;
  T* d_ln = scratch + BT * C;
  T* rest = scratch + 2 * BT * C;

  // Feed-forward: dresid holds d(res3); the residual passes it on to d(res2).
  std::memcpy(d_proj, dresid, bytes);
  cpu::dropout_inplace(d_proj, drop.at(layer_, DropoutSite::kMlpResid), B, Tn, C);
  zero(d_ln, BT * C);
  ffn->backward(ps, r.ffn, selective, d_ln, d_proj, r.ln2, BT, rest, r.ffn_recompute);
  ln_2.backward(ps, dresid, d_ln, r.res2, r.ln2_mean, r.ln2_rstd, BT);

  // Attention: dresid now holds d(res2).
  std::memcpy(d_proj, dresid, bytes);
  cpu::dropout_inplace(d_proj, drop.at(layer_, DropoutSite::kAttnResid), B, Tn, C);
  zero(d_ln, BT * C);
  attn->backward(ps, r.attn, selective, d_ln, d_proj, r.ln1, B, Tn,
                 drop.at(layer_, DropoutSite::kAttnProbs), rest, r.attn_recompute);
  ln_1.backward(ps, dresid, d_ln, x, r.ln1_mean, r.ln1_rstd, BT);
}

template class Block<float>;
template class Block<double>;

}  // namespace loom
