// Mixture of experts in one process: the router (top-k and its tie-break,
// gates, capacity dropping by its stated priority, the two balancing losses
// against values worked out by hand, backward against central finite
// differences), dispatch and combine, and the MoE layer in the feed-forward
// slot against a per-token reference and finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "loom/core/rng.h"
#include "loom/kernels/cpu/matmul.h"
#include "loom/nn/moe.h"
#include "loom/nn/param_store.h"
#include "loom/nn/router.h"

namespace loom {
namespace {

// A router config from its leading fields (tag tokens none).
RouterConfig rc(int experts, int top_k, double capacity_factor,
                RouterKind kind = RouterKind::kLearned) {
  RouterConfig c;
  c.num_experts = experts;
  c.top_k = top_k;
  c.capacity_factor = capacity_factor;
  c.kind = kind;
  return c;
}

// The hash router: k distinct experts per token id, the same for the same
// id wherever it occurs, and over a vocabulary each expert takes close to
// its share (1/E of the k x ids assignments).
TEST(Router, HashRoutesEachIdToFixedDistinctExperts) {
  RouterConfig c = rc(8, 2, 0, RouterKind::kHash);
  std::vector<int32_t> ids(4096);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::vector<int32_t> ex(ids.size() * 2);
  fixed_experts(ids.data(), 4096, 64, c, ex.data());
  std::vector<int> load(8, 0);
  for (size_t t = 0; t < ids.size(); ++t) {
    EXPECT_NE(ex[2 * t], ex[2 * t + 1]) << "token " << t;
    ++load[static_cast<size_t>(ex[2 * t])], ++load[static_cast<size_t>(ex[2 * t + 1])];
  }
  for (int n : load) EXPECT_NEAR(n, 1024, 120);  // 1024 each, a few standard deviations
  // The same id, another position: the same experts.
  const int32_t again[] = {77, 5, 77, 77};
  std::vector<int32_t> ex2(8);
  fixed_experts(again, 4, 4, c, ex2.data());
  for (int t : {0, 2, 3}) {
    EXPECT_EQ(ex2[static_cast<size_t>(2 * t)], ex[2 * 77]);
    EXPECT_EQ(ex2[static_cast<size_t>(2 * t + 1)], ex[2 * 77 + 1]);
  }
  // Fixed gates of 1/k, no losses.
  const Routing<double> r = route_fixed<double>(ex.data(), 4096, 64, c);
  for (double g : r.gate) EXPECT_EQ(g, 0.5);
  EXPECT_EQ(r.aux, 0.0);
  EXPECT_EQ(r.z, 0.0);
}

// The tag router: each token goes by the last tag token at or before it in
// its sample (tag i: experts i k + j mod E), tokens before the sample's
// first tag as tag 0; a decoded sequence's history carries the tag.
TEST(Router, TagRoutesBySampleTagsAndTheirHistory) {
  RouterConfig c{4, 1, 0, RouterKind::kTag, {100, 101, 102}};
  // Two samples of 6: [5 101 6 7 102 8], [9 9 100 3 101 4].
  const int32_t ids[] = {5, 101, 6, 7, 102, 8, 9, 9, 100, 3, 101, 4};
  std::vector<int32_t> ex(12);
  fixed_experts(ids, 12, 6, c, ex.data());
  EXPECT_EQ(ex, (std::vector<int32_t>{0, 1, 1, 1, 2, 2, 0, 0, 0, 0, 1, 1}));
  // Top-2 over 4 experts: tag i takes experts 2i and 2i + 1 (mod 4).
  RouterConfig c2 = c;
  c2.top_k = 2;
  std::vector<int32_t> ex2(24);
  fixed_experts(ids, 12, 6, c2, ex2.data());
  EXPECT_EQ(std::vector<int32_t>(ex2.begin() + 2, ex2.begin() + 4),
            (std::vector<int32_t>{2, 3}));  // token 101: tag 1
  EXPECT_EQ(std::vector<int32_t>(ex2.begin() + 8, ex2.begin() + 12),
            (std::vector<int32_t>{0, 1, 0, 1}));  // tokens 102 and 8: tag 2, 4 and 5 mod 4
  // Decoding token 8 after [5 101 6 7 102]: tag 2 from the history.
  int32_t one = 0;
  fixed_experts(ids + 5, 1, 1, c, &one, 5);
  EXPECT_EQ(one, 2);
  // Equal gates: capacity drops by token, then slot. Sample 0 sends 3
  // tokens to expert 1 and 2 to expert 2; capacity ceil(1.0 x 6 x 1 / 4) = 2.
  c.capacity_factor = 1.0;
  const Routing<float> r = route_fixed<float>(ex.data(), 12, 6, c);
  EXPECT_EQ(r.capacity, 2);
  EXPECT_EQ(r.kept, (std::vector<uint8_t>{1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1}));
  EXPECT_EQ(r.dropped, 3);
}

TEST(Router, TopKGatesAndTieBreak) {
  // Equal logits: every probability ties, so the lowest experts win; the
  // renormalised gates are equal; the balancing loss of uniform
  // probabilities is E x sum_i f_i / E, here 4 x (2/4 x 1/4 + 2/4 x 1/4) = 1.
  std::vector<double> flat(2 * 4, 0.5);
  Routing<double> r = route(flat.data(), 2, 2, rc(4, 2, 0));
  EXPECT_EQ(r.expert, (std::vector<int32_t>{0, 1, 0, 1}));
  for (double g : r.gate) EXPECT_DOUBLE_EQ(g, 0.5);
  EXPECT_DOUBLE_EQ(r.aux, 1.0);
  EXPECT_DOUBLE_EQ(r.z, std::pow(0.5 + std::log(4.0), 2));
  // Distinct logits: the largest first; top-1 keeps the probability itself.
  const double l[] = {0.0, 2.0, 1.0, -1.0};
  Routing<double> one = route(l, 1, 1, rc(4, 1, 0));
  double sum = 0;
  for (double x : l) sum += std::exp(x);
  EXPECT_EQ(one.expert, (std::vector<int32_t>{1}));
  EXPECT_NEAR(one.gate[0], std::exp(2.0) / sum, 1e-15);
  Routing<double> two = route(l, 1, 1, rc(4, 2, 0));
  EXPECT_EQ(two.expert, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(two.gate[0], std::exp(2.0) / (std::exp(2.0) + std::exp(1.0)), 1e-15);
  EXPECT_NEAR(two.gate[0] + two.gate[1], 1.0, 1e-15);
  EXPECT_EQ(two.load, (std::vector<int64_t>{0, 1, 1, 0}));
}

// Bias balancing's bias chooses, the probabilities still weigh.
TEST(Router, BiasChoosesButDoesNotWeigh) {
  const double l[] = {1.0, 0.5, 0.0, 0.2};
  const double bias[] = {0.0, 0.0, 0.9, 0.0};
  const Routing<double> r = route(l, 1, 1, rc(4, 2, 0), bias);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{2, 0}));  // p2 + 0.9 beats p0
  EXPECT_NEAR(r.gate[0], r.probs[2] / (r.probs[2] + r.probs[0]), 1e-15);
  EXPECT_NEAR(r.gate[1], r.probs[0] / (r.probs[2] + r.probs[0]), 1e-15);
}

TEST(Router, CapacityDropsByGateThenTokenWithinEachGroup) {
  // 2 experts, top-1, 4 tokens in one group, capacity factor 1: each
  // expert takes ceil(1 x 4 x 1 / 2) = 2. Tokens 0-2 prefer expert 0 with
  // gates rising 0, 1, 2 steps of logit; token 3 prefers expert 1.
  const double l[] = {1.0, 0.0, 2.0, 0.0, 2.0, 0.0, 0.0, 1.0};
  Routing<double> r = route(l, 4, 4, rc(2, 1, 1.0));
  EXPECT_EQ(r.capacity, 2);
  EXPECT_EQ(r.expert, (std::vector<int32_t>{0, 0, 0, 1}));
  // Token 0 has the smallest gate of expert 0's three: dropped. Tokens 1
  // and 2 tie on their gate: both fit.
  EXPECT_EQ(r.kept, (std::vector<uint8_t>{0, 1, 1, 1}));
  EXPECT_EQ(r.dropped, 1);
  EXPECT_EQ(r.load, (std::vector<int64_t>{3, 1}));
  // The same tokens as two groups of 2: the capacity is ceil(1 x 2 / 2) = 1
  // per group; in the first group tokens 0 and 1 both chose expert 0 and
  // token 1's gate is larger; in the second, tokens 2 and 3 chose
  // different experts.
  Routing<double> g = route(l, 4, 2, rc(2, 1, 1.0));
  EXPECT_EQ(g.capacity, 1);
  EXPECT_EQ(g.kept, (std::vector<uint8_t>{0, 1, 1, 1}));
  // Equal gates for one expert beyond capacity: the earlier token stays.
  const double tie[] = {1.0, 0.0, 1.0, 0.0};
  Routing<double> t = route(tie, 2, 2, rc(2, 1, 0.5));
  EXPECT_EQ(t.capacity, 1);
  EXPECT_EQ(t.kept, (std::vector<uint8_t>{1, 0}));
}

// L = sum(w * gate over kept) + a * aux + b * z, its gradient with respect
// to the logits by route_backward and by central differences.
void check_backward(int E, int k, double capacity, int64_t tokens, int64_t group) {
  const NormalStream rng(7, "router test");
  std::vector<double> logits(static_cast<size_t>(tokens * E)), w(static_cast<size_t>(tokens * k));
  uint64_t n = 0;
  for (auto& x : logits) x = 2.0 * rng.at(n++);
  for (auto& x : w) x = rng.at(n++);
  const double a = 0.3, b = 0.05;
  const RouterConfig c = rc(E, k, capacity);
  auto loss = [&](const std::vector<double>& l) {
    Routing<double> r = route(l.data(), tokens, group, c);
    double s = a * r.aux + b * r.z;
    for (size_t i = 0; i < w.size(); ++i) s += r.kept[i] ? w[i] * r.gate[i] : 0.0;
    return s;
  };
  const Routing<double> r = route(logits.data(), tokens, group, c);
  std::vector<double> got(logits.size());
  route_backward(r, w.data(), a, b, got.data());
  const double eps = 1e-6;
  for (size_t i = 0; i < logits.size(); ++i) {
    std::vector<double> up = logits, down = logits;
    up[i] += eps, down[i] -= eps;
    const double want = (loss(up) - loss(down)) / (2 * eps);
    EXPECT_NEAR(got[i], want, 1e-7 + 1e-6 * std::abs(want))
        << "E " << E << " k " << k << " capacity " << capacity << " logit " << i;
  }
}

TEST(Router, BackwardMatchesFiniteDifferences) {
  check_backward(4, 1, 0, 12, 6);     // Switch: top-1, no dropping
  check_backward(4, 2, 0, 12, 6);     // top-2, renormalised gates
  check_backward(6, 3, 0.75, 12, 4);  // top-3 with dropping
  check_backward(8, 2, 1.0, 16, 8);
}

// Dispatch groups the kept assignments by expert, then token, then slot;
// gather and combine against per-token loops, and their backwards as the
// adjoints they are (<gather(x), R> = <x, gather'(R)>, and the same for
// combine), with dgate in closed form.
TEST(Router, DispatchGatherAndCombine) {
  const int E = 4, k = 2;
  const int64_t tokens = 10, C = 3;
  const NormalStream rng(11, "dispatch test");
  uint64_t n = 0;
  std::vector<double> logits(tokens * E), x(tokens * C), w(tokens * C);
  for (auto& v : logits) v = 2.0 * rng.at(n++);
  for (auto& v : x) v = rng.at(n++);
  for (auto& v : w) v = rng.at(n++);
  const Routing<double> r = route(logits.data(), tokens, 5, rc(E, k, 0.75));
  ASSERT_GT(r.dropped, 0);  // the case with drops
  const Dispatch d = dispatch_order(r);
  ASSERT_EQ(d.offsets.back(), tokens * k - r.dropped);
  for (int e = 0; e < E; ++e)
    for (int64_t i = d.offsets[e]; i < d.offsets[e + 1]; ++i) {
      EXPECT_EQ(r.expert[d.slot[i]], e);
      EXPECT_TRUE(r.kept[d.slot[i]]);
      if (i > d.offsets[e]) {
        EXPECT_LT(d.slot[i - 1], d.slot[i]);  // by token, then slot
      }
    }
  // Each expert's "output": its rows times (e + 1).
  std::vector<double> rows(d.slot.size() * C), y(rows.size());
  gather_rows(d, k, x.data(), C, rows.data());
  for (int e = 0; e < E; ++e)
    for (int64_t i = d.offsets[e] * C; i < d.offsets[e + 1] * C; ++i) y[i] = (e + 1) * rows[i];
  std::vector<double> out(tokens * C, 0.0);
  combine_rows(d, r, y.data(), C, out.data());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double want = 0;
      for (int j = 0; j < k; ++j)
        if (r.kept[t * k + j]) want += r.gate[t * k + j] * (r.expert[t * k + j] + 1) * x[t * C + c];
      EXPECT_NEAR(out[t * C + c], want, 1e-14);
    }
  auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
  };
  // Adjoints.
  std::vector<double> R(rows.size()), dx(x.size(), 0.0);
  for (auto& v : R) v = rng.at(n++);
  gather_rows_backward(d, k, R.data(), C, dx.data());
  EXPECT_NEAR(dot(rows, R), dot(x, dx), 1e-12);
  std::vector<double> dy(y.size()), dgate(tokens * k);
  combine_rows_backward(d, r, y.data(), w.data(), C, dy.data(), dgate.data());
  EXPECT_NEAR(dot(out, w), dot(y, dy), 1e-12);
  for (int64_t t = 0; t < tokens; ++t)
    for (int j = 0; j < k; ++j) {
      double want = 0;
      if (r.kept[t * k + j])
        for (int64_t c = 0; c < C; ++c)
          want += w[t * C + c] * (r.expert[t * k + j] + 1) * x[t * C + c];
      EXPECT_NEAR(dgate[t * k + j], want, 1e-13);
    }
}

// The MoE layer against a per-token reference (each token's output is the
// gate-weighted sum of its kept experts' MLPs, run on that row alone), and
// its backward (inputs, router and expert weights, the balancing losses
// included) against central finite differences of
// J = sum(w * out) + loss_weight * (aux_coef * aux + z_coef * z).
struct MoeFixture {
  static constexpr int64_t C = 8, B = 2, Tn = 6;
  MoeConfig cfg;
  ParamStore<double> ps;
  std::unique_ptr<MoeLayer<double>> moe;
  std::vector<double> x, w;
  MoeFixture() {
    cfg.router = rc(4, 2, 1.0);
    cfg.aux_loss_coef = 0.2;
    cfg.z_loss_coef = 0.05;
    ParamLayout layout;
    layout.begin_unit("u");
    moe = std::make_unique<MoeLayer<double>>(layout, "transformer.h.0.mlp", C, 0.02f, cfg);
    ps.build(std::move(layout), StoreOptions{});
    ps.init(5);
    // Give the router weights a spread that makes routing decisive, and
    // biases values, so every term is exercised.
    const Param& rw = ps.layout()[moe->router_w];
    for (int64_t i = 0; i < rw.numel; ++i) ps.param(rw)[i] *= 40.0;
    for (const Param& p : ps.layout().params())
      if (p.shape.rank() == 1)
        for (int64_t i = 0; i < p.numel; ++i) ps.param(p)[i] = 0.01 * double((i * 7 + 3) % 11);
    const NormalStream rng(3, "moe test");
    uint64_t n = 0;
    x.resize(B * Tn * C), w.resize(B * Tn * C);
    for (auto& v : x) v = rng.at(n++);
    for (auto& v : w) v = rng.at(n++);
  }
  Rows rows() const { return Rows::whole(B, Tn); }
  std::vector<double> forward(bool selective) const {
    std::vector<double> rec(moe->record_elems(rows(), selective)),
        re(std::max<int64_t>(1, moe->recompute_elems(rows(), selective))), out(B * Tn * C);
    moe->forward(ps, rec.data(), selective, out.data(), x.data(), rows(), re.data());
    return out;
  }
  double objective() const {
    const std::vector<double> out = forward(false);
    double j = 0;
    for (size_t i = 0; i < out.size(); ++i) j += w[i] * out[i];
    std::vector<double> logits(B * Tn * cfg.router.num_experts);
    ps.backend().matmul_forward(logits.data(), x.data(), ps.param(moe->router_w),
                                static_cast<const double*>(nullptr), B * Tn, C,
                                int64_t{cfg.router.num_experts});
    const Routing<double> r = route(logits.data(), B * Tn, Tn, cfg.router);
    return j + 0.5 * (cfg.aux_loss_coef * r.aux + cfg.z_loss_coef * r.z);
  }
};

TEST(Moe, ForwardIsTheGateWeightedSumOfEachTokensExperts) {
  MoeFixture f;
  const std::vector<double> out = f.forward(false);
  std::vector<double> logits(f.B * f.Tn * 4);
  f.ps.backend().matmul_forward(logits.data(), f.x.data(), f.ps.param(f.moe->router_w),
                                static_cast<const double*>(nullptr), f.B * f.Tn, f.C, int64_t{4});
  const Routing<double> r = route(logits.data(), f.B * f.Tn, f.Tn, f.cfg.router);
  ASSERT_GT(r.dropped, 0);
  std::vector<double> rec(4 * f.C * 2), y(f.C);
  for (int64_t t = 0; t < f.B * f.Tn; ++t) {
    std::vector<double> want(f.C, 0.0);
    for (int j = 0; j < 2; ++j) {
      if (!r.kept[t * 2 + j]) continue;
      f.moe->expert(r.expert[t * 2 + j])
          .forward(f.ps, rec.data(), false, y.data(), f.x.data() + t * f.C, Rows{1, 1, 0, 1},
                   nullptr);
      for (int64_t c = 0; c < f.C; ++c) want[c] += r.gate[t * 2 + j] * y[c];
    }
    for (int64_t c = 0; c < f.C; ++c) EXPECT_NEAR(out[t * f.C + c], want[c], 1e-12) << t;
  }
  EXPECT_EQ(f.forward(true), out);  // selective recomputation changes nothing
  const MoeStats s = f.moe->take_stats();
  EXPECT_EQ(s.forwards, 2);
  EXPECT_EQ(s.dropped, 2 * r.dropped);
}

TEST(Moe, BackwardMatchesFiniteDifferences) {
  for (bool selective : {false, true}) {
    MoeFixture f;
    f.moe->set_loss_weight(0.5);
    const Rows rows = f.rows();
    std::vector<double> rec(f.moe->record_elems(rows, selective)),
        re(std::max<int64_t>(1, f.moe->recompute_elems(rows, selective))),
        sc(f.moe->scratch_elems(rows)), dx(f.x.size(), 7.0);  // written over
    f.moe->forward(f.ps, rec.data(), selective, nullptr, f.x.data(), rows, re.data());
    f.ps.zero_grads();
    f.moe->backward(f.ps, rec.data(), selective, dx.data(), f.w.data(), f.x.data(), rows, sc.data(),
                    re.data());
    const double eps = 1e-6;
    auto check = [&](double* v, double got, const std::string& what) {
      const double keep = *v;
      *v = keep + eps;
      const double up = f.objective();
      *v = keep - eps;
      const double down = f.objective();
      *v = keep;
      const double want = (up - down) / (2 * eps);
      EXPECT_NEAR(got, want, 1e-6 + 1e-5 * std::abs(want)) << what << " selective " << selective;
    };
    for (size_t i = 0; i < f.x.size(); i += 3) check(&f.x[i], dx[i], "x " + std::to_string(i));
    for (const char* name :
         {"transformer.h.0.mlp.router.weight", "transformer.h.0.mlp.experts.1.c_fc.weight",
          "transformer.h.0.mlp.experts.2.c_proj.bias",
          "transformer.h.0.mlp.experts.0.c_proj.weight"}) {
      const Param& p = f.ps.layout().find(name);
      for (int64_t i = 0; i < p.numel; i += 5)
        check(f.ps.param(p) + i, f.ps.grad(p)[i], std::string(name) + " " + std::to_string(i));
    }
  }
}

}  // namespace
}  // namespace loom
