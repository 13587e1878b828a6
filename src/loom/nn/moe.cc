#include "loom/nn/moe.h"

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/nn/deferred_grads.h"

namespace loom {

namespace {

// Rows per expert (E) from the dispatch order's offsets.
std::vector<int64_t> rows_per_expert(const Dispatch& d) {
  std::vector<int64_t> n(d.offsets.size() - 1);
  for (size_t e = 0; e < n.size(); ++e) n[e] = d.offsets[e + 1] - d.offsets[e];
  return n;
}

}  // namespace

template <typename T>
MoeLayer<T>::MoeLayer(ParamLayout& layout, const std::string& prefix, int64_t C, float proj_std,
                      const MoeConfig& config, std::shared_ptr<ExpertDispatcher<T>> dispatcher)
    : C_(C), config_(config), dispatcher_(std::move(dispatcher)) {
  const int E = config.router.num_experts;
  LOOM_CHECK(E >= 1 && config.router.top_k >= 1 && config.router.top_k <= E,
             "{}: top_k {} of {} experts", prefix, config.router.top_k, E);
  const int ranks = dispatcher_ ? dispatcher_->ranks() : 1;
  LOOM_CHECK_KIND(kConfig, E % ranks == 0,
                  "{}: {} experts do not split over an expert-parallel group of {} (each rank "
                  "holds E / parallel.expert of them)",
                  prefix, E, ranks);
  const int local = E / ranks;
  first_ = dispatcher_ ? dispatcher_->rank() * local : 0;
  LOOM_CHECK(learned() || !config.bias_balancing, "{}: bias balancing needs the learned router",
             prefix);
  if (learned())
    router_w = layout.add(prefix + ".router.weight", {C, E}, true, ParamInit{kInitStd});
  if (config.bias_balancing)
    router_b = layout.add(prefix + ".router.bias", {E}, false, ParamInit{});
  layout.begin_expert_unit(layout.units().back().name + ".experts");
  for (int e = first_; e < first_ + local; ++e)
    experts_.push_back(
        std::make_unique<Mlp<T>>(layout, prefix + ".experts." + std::to_string(e), C, proj_std));
  stats_.load.assign(static_cast<size_t>(E), 0);
}

template <typename T>
int64_t MoeLayer<T>::expert_rows(const Rows& rows) const {
  if (!dispatcher_) return slots(rows);
  const RouterConfig& c = config_.router;
  const int64_t local = static_cast<int64_t>(experts_.size());
  int64_t most = rows.count * std::min<int64_t>(c.top_k, local);
  if (c.capacity_factor > 0) {
    // route()'s capacity per expert and sequence.
    const int64_t capacity = static_cast<int64_t>(std::ceil(
        c.capacity_factor * double(group_tokens(rows)) * double(c.top_k) / double(c.num_experts)));
    most = std::min(most, local * capacity * (rows.count / rows.Tn));
  }
  return most * dispatcher_->ranks();
}

template <typename T>
Rows MoeLayer<T>::local_rows(const Rows& rows, int64_t* row0) const {
  if (row0) *row0 = 0;
  if (!split_ || split_->ranks() == 1 || rows.split()) return rows;
  // The caller sums the gradients over the ranks only when every
  // micro-batch splits, so one that does not is an error, not a fallback.
  LOOM_CHECK(rows.B % split_->ranks() == 0,
             "a micro-batch of {} sequences does not split over {} tensor-parallel ranks", rows.B,
             split_->ranks());
  const int64_t S = rows.B / split_->ranks();  // sequences here
  if (row0) *row0 = split_->rank() * S * rows.Tn;
  return Rows::whole(S, rows.Tn);
}

template <typename T>
int64_t MoeLayer<T>::record_elems(const Rows& all, bool selective) const {
  const Rows rows = local_rows(all);
  const int64_t n = slots(rows), R = expert_rows(rows);
  // logits, the dispatched rows of x, the experts' outputs for them, the
  // rows received (with a dispatcher), the experts' records.
  return logit_elems(rows) + 2 * n * C_ + (dispatcher_ ? R * C_ : 0) +
         experts_[0]->record_elems(Rows::whole(1, R), selective);
}

template <typename T>
int64_t MoeLayer<T>::recompute_elems(const Rows& all, bool selective) const {
  const int64_t R = expert_rows(local_rows(all));
  return experts_[0]->recompute_elems(Rows::whole(1, R), selective);
}

template <typename T>
int64_t MoeLayer<T>::scratch_elems(const Rows& all) const {
  const Rows rows = local_rows(all);
  const int64_t n = slots(rows), R = expert_rows(rows);
  // dy and dx of the dispatched rows, dgate, dlogits, with a dispatcher dy
  // and dx of the rows received, an expert's scratch.
  return 2 * n * C_ + n + logit_elems(rows) + (dispatcher_ ? 2 * R * C_ : 0) +
         experts_[0]->scratch_elems(Rows::whole(1, R));
}

template <typename T>
std::vector<int64_t> MoeLayer<T>::own_index(const Rows& rows) const {
  const ContextSplit cs = context_->split();
  const int64_t Tl = rows.Tn, Tw = Tl * cs.size;
  std::vector<int64_t> at(static_cast<size_t>(rows.count));
  for (int64_t i = 0; i < rows.count; ++i)
    at[static_cast<size_t>(i)] = (i / Tl) * Tw + cs.position(i % Tl, Tl);
  return at;
}

template <typename T>
Routing<T> MoeLayer<T>::whole_routing(const T* logits, const Rows& rows, const T* bias,
                                      int64_t row0) const {
  const ContextSplit cs = context_->split();
  const int P = cs.size, E = config_.router.num_experts;
  const int64_t Tl = rows.Tn, Tw = Tl * P, N = rows.count, S = N / Tl;
  // Rank s's local token (b, t) sits at (b, position_s(t)) of the whole.
  auto place = [&](auto* whole, const auto* every, int64_t w) {
    for (int s = 0; s < P; ++s) {
      const ContextSplit from{s, P, cs.balanced};
      for (int64_t b = 0; b < S; ++b)
        for (int64_t t = 0; t < Tl; ++t)
          std::copy(every + ((s * S + b) * Tl + t) * w, every + ((s * S + b) * Tl + t + 1) * w,
                    whole + (b * Tw + from.position(t, Tl)) * w);
    }
  };
  if (learned()) {
    std::vector<T> every(static_cast<size_t>(P * N * E)), whole(every.size());
    context_->gather(logits, N * E, every.data());
    place(whole.data(), every.data(), E);
    return route(whole.data(), S * Tw, Tw, config_.router, bias);
  }
  LOOM_CHECK(ids_ != nullptr, "a {} router needs the micro-batch's token ids (set_tokens)",
             config_.router.kind == RouterKind::kHash ? "hash" : "tag");
  std::vector<int32_t> every(static_cast<size_t>(P * N)), whole(every.size());
  context_->gather_ids(ids_ + row0 + rows.first, N, every.data());
  place(whole.data(), every.data(), 1);
  std::vector<int32_t> experts(static_cast<size_t>(S * Tw * config_.router.top_k));
  fixed_experts(whole.data(), S * Tw, Tw, config_.router, experts.data(), 0);
  return route_fixed<T>(experts.data(), S * Tw, Tw, config_.router);
}

template <typename T>
Routing<T> MoeLayer<T>::own_part(const Routing<T>& w, const Rows& rows) const {
  const int k = w.k, E = w.experts;
  Routing<T> r;
  r.tokens = rows.count, r.group = rows.Tn, r.k = k, r.experts = E, r.capacity = w.capacity;
  r.aux = w.aux, r.z = w.z;  // the whole sequences' losses, the same on every rank
  r.load.assign(static_cast<size_t>(E), 0);
  const std::vector<int64_t> at = own_index(rows);
  for (int64_t i = 0; i < rows.count; ++i) {
    const size_t f = static_cast<size_t>(at[static_cast<size_t>(i)]);
    for (int j = 0; j < k; ++j) {
      const size_t s = f * k + static_cast<size_t>(j);
      r.expert.push_back(w.expert[s]);
      r.gate.push_back(w.gate[s]);
      r.kept.push_back(w.kept[s]);
      ++r.load[static_cast<size_t>(w.expert[s])];
      r.dropped += w.kept[s] ? 0 : 1;
    }
    if (!w.probs.empty()) {
      r.probs.insert(r.probs.end(), w.probs.begin() + static_cast<int64_t>(f) * E,
                     w.probs.begin() + static_cast<int64_t>(f + 1) * E);
      r.lse.push_back(w.lse[f]);
    }
  }
  return r;
}

template <typename T>
Routing<T> MoeLayer<T>::routing(const T* logits, const Rows& rows, const T* bias,
                                int64_t row0) const {
  LOOM_CHECK_KIND(kUnsupported, !rows.split(),
                  "mixture-of-experts layers do not run under sequence parallelism yet");
  if (context_) return own_part(whole_routing(logits, rows, bias, row0), rows);
  if (learned()) return route(logits, rows.count, rows.Tn, config_.router, bias);
  LOOM_CHECK(ids_ != nullptr, "a {} router needs the micro-batch's token ids (set_tokens)",
             config_.router.kind == RouterKind::kHash ? "hash" : "tag");
  std::vector<int32_t> experts(static_cast<size_t>(slots(rows)));
  fixed_experts(ids_ + row0 + rows.first, rows.count, rows.Tn, config_.router, experts.data(),
                history_);
  return route_fixed<T>(experts.data(), rows.count, rows.Tn, config_.router);
}

template <typename T>
void MoeLayer<T>::experts_forward(const ParamStore<T>& ps, T* rec, bool selective, T* y,
                                  const T* xrows, const std::vector<int64_t>& offsets,
                                  T* recompute) const {
  for (size_t e = 0; e < experts_.size(); ++e) {
    const int64_t b = offsets[e], m = offsets[e + 1] - b;
    if (m == 0) continue;
    const Rows er{1, m, 0, m};
    experts_[e]->forward(ps, rec, selective, y + b * C_, xrows + b * C_, er, recompute);
    rec += experts_[e]->record_elems(er, selective);
  }
}

template <typename T>
void MoeLayer<T>::experts_backward(const ParamStore<T>& ps, T* rec, bool selective, T* dx,
                                   const T* dy, const T* xrows, const std::vector<int64_t>& offsets,
                                   T* scratch, T* recompute) const {
  ps.backend().fill(dx, offsets.back() * C_, T(0));
  for (size_t e = 0; e < experts_.size(); ++e) {
    const int64_t b = offsets[e], m = offsets[e + 1] - b;
    if (m == 0) continue;
    const Rows er{1, m, 0, m};
    experts_[e]->backward(ps, rec, selective, dx + b * C_, dy + b * C_, xrows + b * C_, er, scratch,
                          recompute);
    rec += experts_[e]->record_elems(er, selective);
  }
}

template <typename T>
void MoeLayer<T>::forward(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
                          const Rows& all, T* recompute) const {
  int64_t row0 = 0;
  const Rows rows = local_rows(all, &row0);
  if (rows.count == all.count) {
    forward_rows(ps, record, selective, out, x, rows, recompute, 0);
    return;
  }
  // This rank's sequences, then every rank's outputs gathered.
  if (out == nullptr) {
    forward_rows(ps, record, selective, nullptr, x + row0 * C_, rows, recompute, row0);
    return;
  }
  Buffer mine = ps.backend().alloc(static_cast<size_t>(rows.count * C_) * sizeof(T),
                                   MemCategory::kComm, false);
  forward_rows(ps, record, selective, mine.as<T>(), x + row0 * C_, rows, recompute, row0);
  split_->gather(mine.as<T>(), rows.count * C_, out);
}

template <typename T>
void MoeLayer<T>::forward_rows(const ParamStore<T>& ps, T* record, bool selective, T* out,
                               const T* x, const Rows& rows, T* recompute, int64_t row0) const {
  const auto& be = ps.backend();
  const int E = config_.router.num_experts, k = config_.router.top_k;
  const int64_t N = rows.count, n = slots(rows), R = expert_rows(rows);
  T* logits = record;
  T* xrows = logits + logit_elems(rows);
  T* y = xrows + n * C_;
  T* xe = dispatcher_ ? y + n * C_ : xrows;  // the rows the experts here run
  T* rec = dispatcher_ ? xe + R * C_ : y + n * C_;
  if (learned())
    be.matmul_forward(logits, x, ps.weight(router_w), static_cast<const T*>(nullptr), N, C_,
                      static_cast<int64_t>(E));
  const Routing<T> r = routing(logits, rows, router_b.valid() ? ps.param(router_b) : nullptr, row0);
  const Dispatch d = dispatch_order(r);
  gather_rows(d, k, x, C_, xrows);
  // Each expert once over its rows; their outputs are kept (backward's gate
  // gradients read them), so even a recomputation computes them.
  if (!dispatcher_) {
    experts_forward(ps, rec, selective, y, xrows, d.offsets, recompute);
  } else {
    const ExpertPlan p = dispatcher_->plan(rows_per_expert(d), E);
    LOOM_CHECK(p.rows() <= R, "the experts here received {} rows, more than the {} bounded",
               p.rows(), R);
    dispatcher_->dispatch(p, xrows, C_, xe);
    Buffer ye = be.alloc(static_cast<size_t>(p.rows() * C_) * sizeof(T), MemCategory::kComm);
    experts_forward(ps, rec, selective, ye.as<T>(), xe, p.offsets, recompute);
    dispatcher_->combine(p, ye.as<T>(), C_, y);
  }
  if (out == nullptr) return;  // a recomputation: the statistics counted already
  be.fill(out, N * C_, T(0));
  combine_rows(d, r, y, C_, out);
  for (int e = 0; e < E; ++e) stats_.load[static_cast<size_t>(e)] += r.load[static_cast<size_t>(e)];
  stats_.assignments += n;
  stats_.dropped += r.dropped;
  stats_.aux += r.aux;
  stats_.z += r.z;
  ++stats_.forwards;
}

template <typename T>
void MoeLayer<T>::backward(const ParamStore<T>& ps, T* record, bool selective, T* dx, const T* dout,
                           const T* x, const Rows& all, T* scratch, T* recompute) const {
  int64_t row0 = 0;
  const Rows rows = local_rows(all, &row0);
  // dx is written over: the rows' gradients are sums over their slots.
  if (rows.count == all.count) {
    ps.backend().fill(dx, all.count * C_, T(0));
    backward_rows(ps, record, selective, dx, dout, x, rows, scratch, recompute, 0, 1.0);
    return;
  }
  // This rank's sequences: their input gradients gathered from every rank;
  // the balancing losses here are means over this rank's share of them.
  const int64_t n = rows.count * C_;
  const Backend<T>& be = ps.backend();
  Buffer mine = be.alloc(static_cast<size_t>(n) * sizeof(T), MemCategory::kComm);
  backward_rows(ps, record, selective, mine.as<T>(), dout + row0 * C_, x + row0 * C_, rows, scratch,
                recompute, row0, double(rows.count) / double(all.count));
  split_->gather(mine.as<T>(), n, dx);
}

template <typename T>
void MoeLayer<T>::backward_rows(const ParamStore<T>& ps, T* record, bool selective, T* dx,
                                const T* dout, const T* x, const Rows& rows, T* scratch,
                                T* recompute, int64_t row0, double share) const {
  const int E = config_.router.num_experts, k = config_.router.top_k;
  const int64_t N = rows.count, n = slots(rows), R = expert_rows(rows), L = logit_elems(rows);
  const T* logits = record;
  const T* xrows = logits + L;
  const T* y = xrows + n * C_;
  const T* xe = dispatcher_ ? y + n * C_ : xrows;
  T* rec = record + L + 2 * n * C_ + (dispatcher_ ? R * C_ : 0);
  T* dy = scratch;
  T* dxrows = dy + n * C_;
  T* dgate = dxrows + n * C_;
  T* dlogits = dgate + n;
  T* dye = dispatcher_ ? dlogits + L : dy;  // the experts' side
  T* dxe = dispatcher_ ? dye + R * C_ : dxrows;
  T* mlp_scratch = dispatcher_ ? dxe + R * C_ : dlogits + L;
  // The routing again from the recorded logits (deterministic; the bias
  // moves only between steps).
  const T* bias = router_b.valid() ? ps.param(router_b) : nullptr;
  const Routing<T> whole = context_ ? whole_routing(logits, rows, bias, row0) : Routing<T>{};
  const Routing<T> r = context_ ? own_part(whole, rows) : routing(logits, rows, bias, row0);
  const Dispatch d = dispatch_order(r);
  combine_rows_backward(d, r, y, dout, C_, dy, dgate);
  if (!dispatcher_) {
    experts_backward(ps, rec, selective, dxrows, dy, xrows, d.offsets, mlp_scratch, recompute);
  } else {
    // The same plan as forward's (the same routing on every rank).
    const ExpertPlan p = dispatcher_->plan(rows_per_expert(d), E);
    dispatcher_->dispatch(p, dy, C_, dye);
    experts_backward(ps, rec, selective, dxe, dye, xe, p.offsets, mlp_scratch, recompute);
    dispatcher_->combine(p, dxe, C_, dxrows);
  }
  gather_rows_backward(d, k, dxrows, C_, dx);
  if (!learned()) return;  // fixed gates: nothing reaches a router
  // Under a row split the router's gradients are summed over the ranks, so
  // each rank's means over its share of the sequences count that share.
  if (context_) {
    // The whole sequences' router gradient, this rank's gates' terms in
    // place (the others' zero: a token's row depends on its own gates and
    // the shared loads alone), and this rank's rows of it. The ranks'
    // gradients are averaged over dp x cp: the losses' terms, each counted
    // on the one rank holding its token, carry cp to make up for it.
    const int P = context_->split().size;
    const std::vector<int64_t> at = own_index(rows);
    std::vector<T> dg(static_cast<size_t>(whole.tokens * k), T(0));
    std::vector<T> dl(static_cast<size_t>(whole.tokens * E));
    for (int64_t i = 0; i < N; ++i)
      for (int j = 0; j < k; ++j)
        dg[static_cast<size_t>(at[static_cast<size_t>(i)] * k + j)] = dgate[i * k + j];
    route_backward(whole, dg.data(), config_.aux_loss_coef * loss_weight_ * share * P,
                   config_.z_loss_coef * loss_weight_ * share * P, dl.data());
    for (int64_t i = 0; i < N; ++i)
      std::copy(dl.begin() + at[static_cast<size_t>(i)] * E,
                dl.begin() + (at[static_cast<size_t>(i)] + 1) * E, dlogits + i * E);
  } else {
    route_backward(r, dgate, config_.aux_loss_coef * loss_weight_ * share,
                   config_.z_loss_coef * loss_weight_ * share, dlogits);
  }
  linear_backward(ps, dx, router_w, ParamId{}, dlogits, x, N, C_, static_cast<int64_t>(E));
}

template <typename T>
MoeStats MoeLayer<T>::take_stats() const {
  MoeStats s = stats_;
  stats_ = MoeStats{};
  stats_.load.assign(s.load.size(), 0);
  return s;
}

template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace loom
