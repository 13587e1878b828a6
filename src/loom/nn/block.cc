#include "loom/nn/block.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#include "loom/core/error.h"

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
    : ln_1(f.layer_norm(layout, prefix(layer) + ".ln_1", c.n_embd)),
      attn(f.attention(layout, prefix(layer) + ".attn", c, proj_std(c))),
      ln_2(f.layer_norm(layout, prefix(layer) + ".ln_2", c.n_embd)),
      ffn(f.feed_forward(layout, prefix(layer) + ".mlp", c, proj_std(c), layer)),
      layer_(layer),
      C_(c.n_embd) {}

template <typename T>
BlockRecord<T> Block<T>::bind(Arena<T>& rec, Arena<T>& room, const Rows& rows,
                              Recompute mode) const {
  const int64_t N = rows.count, C = C_;
  BlockRecord<T> r{};
  if (mode == Recompute::kFull) {
    r.res3 = rec.take(N * C);
    return r;
  }
  const bool sel = mode == Recompute::kSelective;
  r.ln1 = rec.take(N * C), r.ln1_mean = rec.take(N), r.ln1_rstd = rec.take(N);
  r.attn = rec.take(attn->record_elems(rows, sel));
  r.attn_recompute = room.take(attn->recompute_elems(rows, sel));
  r.res2 = rec.take(N * C);
  r.ln2 = rec.take(N * C), r.ln2_mean = rec.take(N), r.ln2_rstd = rec.take(N);
  r.ffn = rec.take(ffn->record_elems(rows, sel));
  r.ffn_recompute = room.take(ffn->recompute_elems(rows, sel));
  r.res3 = rec.take(N * C);
  return r;
}

template <typename T>
int64_t Block<T>::record_elems(const Rows& rows, Recompute mode) const {
  Arena<T> rec, room;
  bind(rec, room, rows, mode);
  return rec.used();
}

template <typename T>
int64_t Block<T>::recompute_elems(const Rows& rows, Recompute mode) const {
  Arena<T> rec, room;
  // Full: the whole record is rebuilt in the room before backward.
  bind(rec, room, rows, mode == Recompute::kFull ? Recompute::kNone : mode);
  return mode == Recompute::kFull ? rec.used() : room.used();
}

template <typename T>
int64_t Block<T>::scratch_elems(const Rows& rows) const {
  // d_proj and d_ln, then the attention's or the feed-forward's own (used
  // one after the other, so they share).
  return 2 * rows.count * C_ + std::max(attn->scratch_elems(rows), ffn->scratch_elems(rows));
}

template <typename T>
std::vector<RecordRange> Block<T>::exact_ranges(const Rows& rows, Recompute mode) const {
  LOOM_CHECK(mode != Recompute::kFull, "a block recomputed in full keeps no record to pack");
  const int64_t N = rows.count, C = C_;
  const bool sel = mode == Recompute::kSelective;
  std::vector<RecordRange> out;
  auto add = [&](int64_t base, const std::vector<RecordRange>& rs) {
    for (RecordRange r : rs)
      if (r.count > 0) out.push_back({base + r.offset, r.count});
  };
  // bind's order: ln1, its mean and rstd, attn, res2, ln2, its mean and
  // rstd, ffn, res3.
  int64_t at = N * C;
  out.push_back({at, 2 * N});
  at += 2 * N;
  add(at, attn->exact_ranges(rows, sel));
  at += attn->record_elems(rows, sel) + 2 * N * C;
  out.push_back({at, 2 * N});
  at += 2 * N;
  add(at, ffn->exact_ranges(rows, sel));
  // pack and unpack walk them in order: each after the last, all before
  // the output.
  int64_t end = 0;
  for (RecordRange r : out) {
    LOOM_CHECK(r.offset >= end && r.count > 0, "block {}: exact record ranges out of order",
               layer_);
    end = r.offset + r.count;
  }
  LOOM_CHECK(end <= record_elems(rows, mode) - N * C, "block {}: an exact range past the record",
             layer_);
  return out;
}

template <typename T>
int64_t Block<T>::packed_elems(const Rows& rows, Recompute mode) const {
  const int64_t total = record_elems(rows, mode), output = rows.count * C_;
  int64_t exact = 0;
  for (RecordRange r : exact_ranges(rows, mode)) exact += r.count;
  const int64_t rounded = total - output - exact;
  // 16-bit elements two to an element of T (T is f32 where records pack).
  return output + exact + (rounded + 1) / 2;
}

template <typename T>
std::vector<RecordRange> Block<T>::twin_ranges(const Rows& rows, Recompute mode, bool linears16,
                                               bool shared) const {
  LOOM_CHECK(mode != Recompute::kFull, "a block recomputed in full keeps no record to pack");
  const int64_t N = rows.count, C = C_;
  const bool sel = mode == Recompute::kSelective;
  std::vector<RecordRange> out;
  auto add = [&](int64_t base, std::vector<RecordRange> rs) {
    std::sort(rs.begin(), rs.end(),
              [](RecordRange a, RecordRange b) { return a.offset < b.offset; });
    for (RecordRange r : rs)
      if (r.count > 0) out.push_back({base + r.offset, r.count});
  };
  auto with_shared = [&](std::vector<RecordRange> rs, const std::vector<RecordRange>& more) {
    if (shared && linears16) rs.insert(rs.end(), more.begin(), more.end());
    return rs;
  };
  // bind's order: ln1, its mean and rstd, attn, res2, ln2, its mean and
  // rstd, ffn, res3.
  if (linears16 && attn->input_twin()) out.push_back({0, N * C});
  int64_t at = N * C + 2 * N;
  add(at,
      with_shared(attn->twin_ranges(rows, sel, linears16), attn->shared_twin_ranges(rows, sel)));
  at += attn->record_elems(rows, sel) + N * C;
  if (linears16 && ffn->input_twin()) out.push_back({at, N * C});
  at += N * C + 2 * N;
  add(at, ffn->twin_ranges(rows, sel, linears16));
  return out;
}

template <typename T>
uint16_t* Block<T>::rounded_part(T* slot, const Rows& rows, Recompute mode) const {
  int64_t exact = 0;
  for (RecordRange r : exact_ranges(rows, mode)) exact += r.count;
  return reinterpret_cast<uint16_t*>(slot + rows.count * C_ + exact);
}

namespace {

// Calls f(b, e) for each part [b, e) of [lo, hi) outside `skip` (sorted).
template <typename F>
void outside(int64_t lo, int64_t hi, const std::vector<RecordRange>& skip, F f) {
  int64_t at = lo;
  for (RecordRange s : skip) {
    const int64_t b = std::max(at, s.offset), e = std::min(hi, s.offset + s.count);
    if (b >= e) continue;
    if (b > at) f(at, b);
    at = e;
  }
  if (at < hi) f(at, hi);
}

}  // namespace

// (A mixture of experts' record is sized for the most rows its experts can
// receive; the part no row reached this micro-batch is packed too, its
// values unused.)
template <typename T>
void Block<T>::pack(const Backend<T>& be, const T* whole, T* slot, const Rows& rows, Recompute mode,
                    DType t, const std::vector<RecordRange>& skip) const {
  if constexpr (std::is_same_v<T, float>) {
    const int64_t total = record_elems(rows, mode) - rows.count * C_;  // the output aside
    const std::vector<RecordRange> ranges = exact_ranges(rows, mode);
    T* exact = slot + rows.count * C_;
    int64_t exact_n = 0;
    for (RecordRange r : ranges) exact_n += r.count;
    uint16_t* rounded = reinterpret_cast<uint16_t*>(exact + exact_n);
    int64_t at = 0, done = 0;  // done: exact elements before `at`
    auto round = [&](int64_t lo, int64_t hi) {
      outside(lo, hi, skip, [&](int64_t b, int64_t e) {
        be.round_16(whole + b, rounded + (b - done), e - b, t);
      });
    };
    for (RecordRange r : ranges) {
      round(at, r.offset);
      be.copy(exact, whole + r.offset, r.count);
      exact += r.count;
      done += r.count;
      at = r.offset + r.count;
    }
    round(at, total);
  } else {
    (void)skip;
    LOOM_FAIL(kUnsupported, "16-bit records need f32 layers");
  }
}

template <typename T>
void Block<T>::unpack(const Backend<T>& be, const T* slot, T* whole, const Rows& rows,
                      Recompute mode, DType t, const std::vector<RecordRange>& skip) const {
  if constexpr (std::is_same_v<T, float>) {
    const int64_t total = record_elems(rows, mode) - rows.count * C_;
    const std::vector<RecordRange> ranges = exact_ranges(rows, mode);
    const T* exact = slot + rows.count * C_;
    int64_t exact_n = 0;
    for (RecordRange r : ranges) exact_n += r.count;
    const uint16_t* rounded = reinterpret_cast<const uint16_t*>(exact + exact_n);
    int64_t at = 0, done = 0;
    auto widen = [&](int64_t lo, int64_t hi) {
      outside(lo, hi, skip, [&](int64_t b, int64_t e) {
        be.widen_16(rounded + (b - done), whole + b, e - b, t);
      });
    };
    for (RecordRange r : ranges) {
      widen(at, r.offset);
      be.copy(whole + r.offset, exact, r.count);
      exact += r.count;
      done += r.count;
      at = r.offset + r.count;
    }
    widen(at, total);
  } else {
    (void)skip;
    LOOM_FAIL(kUnsupported, "16-bit records need f32 layers");
  }
}

template <typename T>
void Block<T>::forward(const ParamStore<T>& ps, const BlockRecord<T>& r, const T* x,
                       const Rows& rows, bool selective, const Dropout& drop,
                       bool record_only) const {
  const auto& be = ps.backend();
  const int64_t N = rows.count, C = C_;
  ln_1->forward(ps, r.ln1, r.ln1_mean, r.ln1_rstd, x, N);
  attn->forward(ps, r.attn, selective, r.res2, r.ln1, rows,
                drop.at(layer_, DropoutSite::kAttnProbs), r.attn_recompute);
  drop.apply_add(be, r.res2, r.res2, x, layer_, DropoutSite::kAttnResid, rows, C);
  ln_2->forward(ps, r.ln2, r.ln2_mean, r.ln2_rstd, r.res2, N);
  ffn->forward(ps, r.ffn, selective, record_only ? nullptr : r.res3, r.ln2, rows, r.ffn_recompute);
  if (record_only) return;
  drop.apply_add(be, r.res3, r.res3, r.res2, layer_, DropoutSite::kMlpResid, rows, C);
}

template <typename T>
void Block<T>::backward(const ParamStore<T>& ps, const BlockRecord<T>& r, const T* x, T* dresid,
                        const Rows& rows, bool selective, const Dropout& drop, T* scratch) const {
  const auto& be = ps.backend();
  const int64_t N = rows.count, C = C_;
  T* d_proj = scratch;
  T* d_ln = scratch + N * C;
  T* rest = scratch + 2 * N * C;

  // A branch's output gradient: dresid through the branch's dropout masks
  // into d_proj, or dresid itself without dropout (the branch reads it
  // before the LayerNorm's backward adds into it).
  auto branch_dout = [&](DropoutSite site) -> const T* {
    if (!drop.at(layer_, site).active()) return dresid;
    drop.apply_add(be, d_proj, dresid, static_cast<const T*>(nullptr), layer_, site, rows, C);
    return d_proj;
  };
  // Feed-forward: dresid holds d(res3); the residual passes it on to d(res2).
  // Each branch writes its input's gradient into d_ln (no zero fill first).
  const T* d_mlp = branch_dout(DropoutSite::kMlpResid);
  ffn->backward(ps, r.ffn, selective, d_ln, d_mlp, r.ln2, rows, rest, r.ffn_recompute);
  ln_2->backward(ps, dresid, d_ln, r.res2, r.ln2_mean, r.ln2_rstd, N);

  // Attention: dresid now holds d(res2).
  const T* d_attn = branch_dout(DropoutSite::kAttnResid);
  attn->backward(ps, r.attn, selective, d_ln, d_attn, r.ln1, rows,
                 drop.at(layer_, DropoutSite::kAttnProbs), rest, r.attn_recompute);
  ln_1->backward(ps, dresid, d_ln, x, r.ln1_mean, r.ln1_rstd, N);
}

template class Block<float>;
template class Block<double>;

}  // namespace loom
