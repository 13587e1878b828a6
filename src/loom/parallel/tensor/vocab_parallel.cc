#include "loom/parallel/tensor/vocab_parallel.h"
#include "loom/nn/deferred_grads.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom::tp {

namespace {

void check_vocab(const GptConfig& c, const Group& g) {
  LOOM_CHECK(c.padded_vocab() % g.size() == 0,
             "the padded vocabulary {} does not split into parallel.tensor {} ranges",
             c.padded_vocab(), g.size());
}

}  // namespace

VocabParallelEmbedding::VocabParallelEmbedding(ParamLayout& layout, const GptConfig& c,
                                               const Group& g)
    : g_(g), C_(c.n_embd) {
  check_vocab(c, g);
  const int64_t rows = c.padded_vocab() / g.size();
  v0_ = g.rank() * rows;
  v1_ = v0_ + rows;
  wte_ = layout.add("transformer.wte.weight", {c.padded_vocab(), c.n_embd}, true,
                    ParamInit{kInitStd, 0, c.vocab_size}, ShardSpec::vocab(g.rank(), g.size()));
  wpe_ = layout.add("transformer.wpe.weight", {c.seq_len, c.n_embd}, true, ParamInit{kInitStd});
}

void VocabParallelEmbedding::forward(const ParamStore<float>& ps, float* out, const int32_t* tokens,
                                     const Rows& rows, const Dropout& drop) const {
  const auto& be = ps.backend();
  const Weight<float> wte = ps.weight(wte_);  // 16-bit values widened as read
  const int64_t BT = rows.all(), Tn = rows.Tn;
  Buffer all;  // sequence parallelism: every row, before the reduce-scatter
  float* look = out;
  if (rows.split()) {
    all = be.alloc(static_cast<size_t>(BT * C_) * sizeof(float), MemCategory::kWorkspace, false);
    look = all.as<float>();
  }
  be.embedding_lookup(look, tokens, wte, BT, C_, v0_, v1_);
  if (rows.split())
    g_.reduce_scatter(look, out, rows.count * C_);
  else
    reduce_from_region_forward(g_, out, BT * C_);
  be.add_positions(out, ps.weight(wpe_), Tn, C_, rows.first, rows.count, rows.pos);
  drop.apply(be, out, -1, DropoutSite::kEmbedding, rows, C_);
}

void VocabParallelEmbedding::backward(const ParamStore<float>& ps, float* dout,
                                      const int32_t* tokens, const Rows& rows,
                                      const Dropout& drop) const {
  const auto& be = ps.backend();
  drop.apply(be, dout, -1, DropoutSite::kEmbedding, rows, C_);
  const int64_t B = rows.B, Tn = rows.Tn, BT = rows.all();
  Buffer all;  // sequence parallelism: every row's gradient, gathered
  if (rows.split()) {
    all = be.alloc(static_cast<size_t>(BT * C_) * sizeof(float), MemCategory::kWorkspace, false);
    g_.gather(dout, all.as<float>(), rows.count * C_);
    dout = all.as<float>();
  }
  // The single-process lookup's backward over this rank's vocabulary rows;
  // wpe is whole on every rank and every rank has the whole gradient.
  const int64_t C = C_, v0 = v0_, v1 = v1_;
  const ParamId wte = wte_, wpe = wpe_;
  const int32_t* pos = rows.pos;  // the stage's, alive as long as the stage
  if (DeferredGrads<float>* d = ps.deferral()) {
    const float* dy = d->keep(static_cast<const float*>(dout), BT * C);
    const int32_t* tok = d->keep(tokens, BT);
    d->add([=](const ParamStore<float>& s) {
      s.backend().encoder_backward(s.grad(wte), s.grad(wpe), dy, tok, B, Tn, C, v0, v1, pos);
    });
    return;
  }
  be.encoder_backward(ps.grad(wte), ps.grad(wpe), dout, tokens, B, Tn, C, v0, v1, pos);
}

VocabParallelHead::VocabParallelHead(std::unique_ptr<LayerNorm<float>> ln, const GptConfig& c,
                                     const Group& g)
    : HeadLayer<float>(std::move(ln)), g_(g), c_(c) {
  check_vocab(c, g);
  Vl_ = c.padded_vocab() / g.size();
  v0_ = g.rank() * Vl_;
}

ParamId VocabParallelHead::declare_wte(ParamLayout& layout) {
  wte_ = layout.add("transformer.wte.weight", {c_.padded_vocab(), c_.n_embd}, true,
                    ParamInit{kInitStd, 0, c_.vocab_size}, ShardSpec::vocab(g_.rank(), g_.size()));
  return wte_;
}

HeadRecord<float> VocabParallelHead::bind(Arena<float>& rec, Arena<float>& room, const Rows& rows,
                                          bool recompute_logits) const {
  const int64_t N = rows.count, BT = rows.all(), C = c_.n_embd;
  HeadRecord<float> r{};
  r.lnf = rec.take(N * C), r.lnf_mean = rec.take(N), r.lnf_rstd = rec.take(N);
  r.lnf_all = rows.split() ? rec.take(BT * C) : r.lnf;
  r.logits = (recompute_logits ? room : rec).take(BT * Vl_);
  r.losses = rec.take(BT), r.lse = rec.take(BT);
  return r;
}

void VocabParallelHead::logits_forward(const ParamStore<float>& ps, const HeadRecord<float>& r,
                                       const Rows& rows) const {
  const auto& be = ps.backend();
  if (rows.split()) g_.gather(r.lnf, r.lnf_all, rows.count * c_.n_embd);
  be.matmul_nt_forward(r.logits, r.lnf_all, ps.weight(wte_), rows.all(), c_.n_embd, Vl_);
}

double VocabParallelHead::loss(const ParamStore<float>& ps, const HeadRecord<float>& r,
                               const int32_t* targets, const Rows& rows) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.all();
  // Columns of this rank that are real vocabulary (the rest is padding).
  const int64_t valid = std::clamp<int64_t>(c_.vocab_size - v0_, 0, Vl_);
  std::vector<float> mx(static_cast<size_t>(BT)), sum(static_cast<size_t>(BT)),
      target(static_cast<size_t>(BT));
  be.vocab_logit_stats(mx.data(), target.data(), r.logits, targets, BT, valid, Vl_, v0_);
  g_.max(mx.data(), BT);
  be.vocab_sum_exp(sum.data(), r.logits, mx.data(), BT, valid, Vl_);
  g_.sum(sum.data(), BT);
  g_.sum(target.data(), BT);
  double total = 0;
  for (int64_t n = 0; n < BT; ++n) {
    const size_t i = static_cast<size_t>(n);
    r.lse[n] = mx[i] + std::log(sum[i]);
    r.losses[n] = r.lse[n] - target[i];
    total += r.losses[n];
  }
  return total;
}

void VocabParallelHead::logits_backward(const ParamStore<float>& ps, const HeadRecord<float>& r,
                                        const int32_t* targets, const float* dloss, float* d_lnf,
                                        const Rows& rows) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.all();
  const int64_t valid = std::clamp<int64_t>(c_.vocab_size - v0_, 0, Vl_);
  be.cross_entropy_backward(r.logits, r.lse, targets, dloss, BT, valid, Vl_, v0_);
  // The partial input gradient of this rank's vocabulary, summed over the
  // group (reduce-scattered to this rank's rows when the sequence is split).
  const int64_t C = c_.n_embd;
  Buffer part = be.alloc(static_cast<size_t>(BT * C) * sizeof(float), MemCategory::kWorkspace);
  tied_head_backward(ps, part.as<float>(), wte_, r.logits, r.lnf_all, BT, C, Vl_);
  if (rows.split()) {
    Buffer mine = be.alloc(static_cast<size_t>(rows.count * C) * sizeof(float),
                           MemCategory::kWorkspace, false);
    g_.reduce_scatter(part.as<float>(), mine.as<float>(), rows.count * C);
    be.add(d_lnf, mine.as<float>(), rows.count * C);
  } else {
    copy_to_region_backward(g_, part.as<float>(), BT * C);
    be.add(d_lnf, part.as<float>(), BT * C);
  }
}

void SequenceParallelLayerNorm::backward(const ParamStore<float>& ps, float* dx, const float* dout,
                                         const float* x, const float* mean, const float* rstd,
                                         int64_t N) const {
  // This rank's rows' share of the parameter gradients, summed over the group.
  const Group* g = &g_;  // outlives a deferred call: the layer does
  layernorm_backward<float>(ps, dx, weight, bias, dout, x, mean, rstd, N, C_,
                            [g](float* part, int64_t n) { g->sum(part, n); });
}

}  // namespace loom::tp
