// One table drives every kernel test: each op runs (1) in f32 against its
// naive double reference and (2) backward in double against central finite
// differences of L = sum_o <out_o, r_o> with random r.
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "loom/kernels/cpu/adamw.h"
#include "loom/kernels/cpu/attention.h"
#include "loom/kernels/cpu/cross_entropy.h"
#include "loom/kernels/cpu/elementwise.h"
#include "loom/kernels/cpu/encoder.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/cpu/layernorm.h"
#include "loom/kernels/cpu/matmul.h"
#include "reference.h"

namespace loom {
namespace {

template <typename T>
using Vecs = std::vector<std::vector<T>>;
using Forward = std::function<void(const Vecs<double>&, Vecs<double>&)>;
using ForwardF = std::function<void(const Vecs<float>&, Vecs<float>&)>;
// (inputs, outputs of forward, gradients of outputs) -> gradients of inputs (zeroed on entry)
using Backward = std::function<void(const Vecs<double>&, const Vecs<double>&, const Vecs<double>&,
                                    Vecs<double>&)>;
using BackwardF =
    std::function<void(const Vecs<float>&, const Vecs<float>&, const Vecs<float>&, Vecs<float>&)>;

struct Op {
  std::string name;
  std::vector<int64_t> in_sizes, out_sizes;
  std::vector<bool> in_loss;  // per output: part of the scalar loss
  Forward reference;
  ForwardF forward_f;
  Forward forward_d;
  Backward backward_d;
  BackwardF backward_f;  // the f32 path that trains (GEMM backend, vectorised exp/tanh)
  double fwd_tol = 2e-5;
  bool accumulates = true;  // backward adds into the input gradients (else overwrites them)
  std::function<void(Vecs<double>&)> adjust_inputs = nullptr;
};

Op make_op(std::string name, std::vector<int64_t> in_sizes, std::vector<int64_t> out_sizes,
           std::vector<bool> in_loss) {
  Op op;
  op.name = std::move(name);
  op.in_sizes = std::move(in_sizes);
  op.out_sizes = std::move(out_sizes);
  op.in_loss = std::move(in_loss);
  return op;
}

template <typename T>
Vecs<T> sized(const std::vector<int64_t>& sizes) {
  Vecs<T> v;
  for (int64_t n : sizes) v.emplace_back(static_cast<size_t>(n), T(0));
  return v;
}

Vecs<double> random_inputs(const Op& op, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  Vecs<double> in = sized<double>(op.in_sizes);
  for (auto& v : in)
    for (auto& x : v) x = dist(gen);
  if (op.adjust_inputs) op.adjust_inputs(in);
  return in;
}

Vecs<float> to_float(const Vecs<double>& v) {
  Vecs<float> f;
  for (const auto& x : v) f.emplace_back(x.begin(), x.end());
  return f;
}

double loss_of(const Op& op, const Vecs<double>& out, const Vecs<double>& r) {
  double L = 0;
  for (size_t o = 0; o < out.size(); ++o)
    if (op.in_loss[o])
      for (size_t i = 0; i < out[o].size(); ++i) L += out[o][i] * r[o][i];
  return L;
}

// The r of L = sum_o <out_o, r_o>: normal, zero for outputs not in the loss.
Vecs<double> loss_weights(const Op& op, uint32_t seed) {
  Vecs<double> r = sized<double>(op.out_sizes);
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist;
  for (size_t o = 0; o < r.size(); ++o)
    if (op.in_loss[o])
      for (auto& x : r[o]) x = dist(gen);
  return r;
}

// --- the table -------------------------------------------------------------

constexpr int64_t kB = 2, kT = 70, kC = 16, kNH = 2;  // T > one 64-wide block

std::vector<int32_t> make_tokens(int64_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(gen() % static_cast<uint32_t>(vocab));
  return t;
}

std::vector<Op> make_ops() {
  std::vector<Op> ops;
  {
    const int64_t N = 13, C = 7, OC = 9;
    Op op = make_op("matmul", {N * C, C * OC, OC}, {N * OC}, {true});
    op.reference = [=](const Vecs<double>& in, Vecs<double>& out) {
      ref::matmul(out[0], in[0], in[1], &in[2], N, C, OC);
    };
    auto fwd = [=](const auto& in, auto& out) {
      cpu::matmul_forward(out[0].data(), in[0].data(), in[1].data(), in[2].data(), N, C, OC);
    };
    op.forward_f = fwd;
    op.forward_d = fwd;
    auto bwd = [=](const auto& in, const auto&, const auto& d, auto& g) {
      cpu::matmul_backward(g[0].data(), g[1].data(), g[2].data(), d[0].data(), in[0].data(),
                           in[1].data(), N, C, OC);
    };
    op.backward_d = bwd;
    op.backward_f = bwd;
    ops.push_back(op);
  }
  {
    const int64_t N = 11, C = 8, V = 10;
    Op op = make_op("matmul_nt (tied lm head)", {N * C, V * C}, {N * V}, {true});
    op.reference = [=](const Vecs<double>& in, Vecs<double>& out) {
      std::vector<double> wt(static_cast<size_t>(C * V));
      for (int64_t v = 0; v < V; ++v)
        for (int64_t c = 0; c < C; ++c) wt[c * V + v] = in[1][v * C + c];
      ref::matmul(out[0], in[0], wt, nullptr, N, C, V);
    };
    auto fwd = [=](const auto& in, auto& out) {
      cpu::matmul_nt_forward(out[0].data(), in[0].data(), in[1].data(), N, C, V);
    };
    op.forward_f = fwd;
    op.forward_d = fwd;
    auto bwd = [=](const auto& in, const auto&, const auto& d, auto& g) {
      cpu::matmul_nt_backward(g[0].data(), g[1].data(), d[0].data(), in[0].data(), in[1].data(), N,
                              C, V);
    };
    op.backward_d = bwd;
    op.backward_f = bwd;
    ops.push_back(op);
  }
  {
    const int64_t B = 2, T = 5, C = 6, V = 9;
    auto tokens = make_tokens(B * T, static_cast<int32_t>(V), 7);
    Op op = make_op("encoder", {V * C, T * C}, {B * T * C}, {true});
    op.reference = [=](const Vecs<double>& in, Vecs<double>& out) {
      for (int64_t i = 0; i < B * T; ++i)
        for (int64_t c = 0; c < C; ++c)
          out[0][i * C + c] = in[0][tokens[i] * C + c] + in[1][(i % T) * C + c];
    };
    auto fwd = [=](const auto& in, auto& out) {
      cpu::encoder_forward(out[0].data(), tokens.data(), in[0].data(), in[1].data(), B, T, C);
    };
    op.forward_f = fwd;
    op.forward_d = fwd;
    auto bwd = [=](const auto&, const auto&, const auto& d, auto& g) {
      cpu::encoder_backward(g[0].data(), g[1].data(), d[0].data(), tokens.data(), B, T, C);
    };
    op.backward_d = bwd;
    op.backward_f = bwd;
    ops.push_back(op);
  }
  {
    const int64_t N = 9, C = 12;
    Op op = make_op("layernorm", {N * C, C, C}, {N * C, N, N}, {true, false, false});
    op.reference = [=](const Vecs<double>& in, Vecs<double>& out) {
      ref::layernorm(out[0], in[0], in[1], in[2], N, C);
    };
    auto fwd = [=](const auto& in, auto& out) {
      cpu::layernorm_forward(out[0].data(), out[1].data(), out[2].data(), in[0].data(),
                             in[1].data(), in[2].data(), N, C);
    };
    op.forward_f = fwd;
    op.forward_d = fwd;
    auto bwd = [=](const auto& in, const auto& out, const auto& d, auto& g) {
      cpu::layernorm_backward(g[0].data(), g[1].data(), g[2].data(), d[0].data(), in[0].data(),
                              in[1].data(), out[1].data(), out[2].data(), N, C);
    };
    op.backward_d = bwd;
    op.backward_f = bwd;
    ops.push_back(op);
  }
  {
    const int64_t n = 300;
    Op op = make_op("gelu", {n}, {n}, {true});
    op.adjust_inputs = [](Vecs<double>& in) {
      for (auto& x : in[0]) x *= 4;  // cover the saturated tails too
    };
    op.reference = [=](const Vecs<double>& in, Vecs<double>& out) {
      for (int64_t i = 0; i < n; ++i) out[0][i] = ref::gelu(in[0][i]);
    };
    auto fwd = [=](const auto& in, auto& out) {
      cpu::gelu_forward(out[0].data(), in[0].data(), n);
    };
    op.forward_f = fwd;
    op.forward_d = fwd;
    auto bwd = [=](const auto& in, const auto&, const auto& d, auto& g) {
      cpu::gelu_backward(g[0].data(), in[0].data(), d[0].data(), n);
    };
    op.backward_d = bwd;
    op.backward_f = bwd;
    ops.push_back(op);
  }
  {
    const int64_t n = 50;
    Op op = make_op("residual", {n, n}, {n}, {true});
    op.reference = [=](const Vecs<double>& in, Vecs<double>& out) {
      for (int64_t i = 0; i < n; ++i) out[0][i] = in[0][i] + in[1][i];
    };
    auto fwd = [=](const auto& in, auto& out) {
      cpu::residual_forward(out[0].data(), in[0].data(), in[1].data(), n);
    };
    op.forward_f = fwd;
    op.forward_d = fwd;
    auto bwd = [=](const auto&, const auto&, const auto& d, auto& g) {
      cpu::add_inplace(g[0].data(), d[0].data(), n);
      cpu::add_inplace(g[1].data(), d[0].data(), n);
    };
    op.backward_d = bwd;
    op.backward_f = bwd;
    ops.push_back(op);
  }
  for (float p : {0.0f, 0.25f}) {
    static DropoutStream streams[2] = {DropoutStream(11, 3, 0.0f), DropoutStream(11, 3, 0.25f)};
    const DropoutStream* stream = &streams[p > 0 ? 1 : 0];
    cpu::AttentionDropout drop{stream, 5, dropout_site(1, DropoutSite::kAttnProbs)};
    Op op = make_op(p > 0 ? "attention (dropout 0.25)" : "attention", {kB * kT * 3 * kC},
                    {kB * kT * kC, kB * kNH * kT}, {true, false});
    op.reference = [=](const Vecs<double>& in, Vecs<double>& out) {
      ref::attention(out[0], in[0], kB, kT, kC, kNH, stream, drop.sample0, drop.site);
    };
    auto fwd = [=](const auto& in, auto& out) {
      cpu::attention_forward(out[0].data(), out[1].data(), in[0].data(), kB, kT, kC, kNH, drop);
    };
    op.forward_f = fwd;
    op.forward_d = fwd;
    auto bwd = [=](const auto& in, const auto& out, const auto& d, auto& g) {
      cpu::attention_backward(g[0].data(), d[0].data(), in[0].data(), out[0].data(), out[1].data(),
                              kB, kT, kC, kNH, drop);
    };
    op.backward_d = bwd;
    op.backward_f = bwd;
    ops.push_back(op);
  }
  {
    const int64_t N = 10, V = 50, Vp = 64;
    auto targets = make_tokens(N, static_cast<int32_t>(V), 3);
    Op op = make_op("cross_entropy (padded vocab)", {N * Vp}, {N, N}, {true, false});
    op.accumulates = false;  // overwrites the logits with their gradient
    op.adjust_inputs = [=](Vecs<double>& in) {
      for (int64_t n = 0; n < N; ++n)  // padding may hold anything; it must not count
        for (int64_t v = V; v < Vp; ++v) in[0][n * Vp + v] = 100.0;
    };
    op.reference = [=](const Vecs<double>& in, Vecs<double>& out) {
      ref::cross_entropy(out[0], in[0], targets, N, V, Vp);
    };
    auto fwd = [=](const auto& in, auto& out) {
      cpu::cross_entropy_forward(out[0].data(), out[1].data(), in[0].data(), targets.data(), N, V,
                                 Vp);
    };
    op.forward_f = fwd;
    op.forward_d = fwd;
    auto bwd = [=](const auto& in, const auto& out, const auto& d, auto& g) {
      g[0] = in[0];
      cpu::cross_entropy_backward(g[0].data(), out[1].data(), targets.data(), d[0].data(), N, V,
                                  Vp);
    };
    op.backward_d = bwd;
    op.backward_f = bwd;
    ops.push_back(op);
  }
  return ops;
}

class KernelTest : public ::testing::TestWithParam<size_t> {};

TEST_P(KernelTest, ForwardF32MatchesReference) {
  const Op op = make_ops()[GetParam()];
  Vecs<double> in = random_inputs(op, 1);
  Vecs<double> want = sized<double>(op.out_sizes);
  op.reference(in, want);
  Vecs<float> got = sized<float>(op.out_sizes);
  op.forward_f(to_float(in), got);
  for (size_t o = 0; o < want.size(); ++o) {
    if (!op.in_loss[o]) continue;  // saved statistics have no reference
    for (size_t i = 0; i < want[o].size(); ++i)
      ASSERT_NEAR(got[o][i], want[o][i], op.fwd_tol * (1 + std::abs(want[o][i])))
          << op.name << " output " << o << " element " << i;
  }
}

TEST_P(KernelTest, BackwardMatchesFiniteDifferences) {
  const Op op = make_ops()[GetParam()];
  Vecs<double> in = random_inputs(op, 2);
  Vecs<double> out = sized<double>(op.out_sizes);
  op.forward_d(in, out);
  // The analytic forward in double equals the reference too.
  Vecs<double> want = sized<double>(op.out_sizes);
  op.reference(in, want);
  for (size_t o = 0; o < out.size(); ++o) {
    if (!op.in_loss[o]) continue;
    for (size_t i = 0; i < out[o].size(); ++i)
      ASSERT_NEAR(out[o][i], want[o][i], 1e-9 * (1 + std::abs(want[o][i]))) << op.name;
  }

  const Vecs<double> r = loss_weights(op, 3);
  Vecs<double> grads = sized<double>(op.in_sizes);
  op.backward_d(in, out, r, grads);

  const double h = 1e-6;
  for (size_t k = 0; k < in.size(); ++k) {
    size_t n = in[k].size();
    size_t stride = std::max<size_t>(1, n / 40);  // about 40 probes per input
    for (size_t i = 0; i < n; i += stride) {
      Vecs<double> plus = in, minus = in;
      plus[k][i] += h;
      minus[k][i] -= h;
      Vecs<double> op_out = sized<double>(op.out_sizes), om_out = sized<double>(op.out_sizes);
      op.forward_d(plus, op_out);
      op.forward_d(minus, om_out);
      double fd = (loss_of(op, op_out, r) - loss_of(op, om_out, r)) / (2 * h);
      ASSERT_NEAR(grads[k][i], fd, 1e-5 * (1 + std::abs(fd)))
          << op.name << " input " << k << " element " << i;
    }
  }
}

// The f32 kernels that train, against central differences of their own f32
// forward, on every GEMM backend: what the double test above cannot see (in
// double the GEMMs take dgemm and exp/tanh fall back to libm). h = 1e-2 on
// inputs O(1): truncation O(h^2) ~ 1e-4 and f32 rounding of the loss / 2h ~
// 1e-4, so a bound of 3e-3 (1 + |fd|) holds while a wrong factor or a
// missing term (O(1)) does not.
TEST_P(KernelTest, BackwardF32MatchesFiniteDifferencesOnEveryGemmBackend) {
  const Op op = make_ops()[GetParam()];
  // Put back even when an assertion returns early.
  struct Restore {
    cpu::GemmBackend b = cpu::gemm_backend();
    ~Restore() { cpu::set_gemm_backend(b); }
  } restore;
  for (cpu::GemmBackend b : {cpu::GemmBackend::kOpenBlas, cpu::GemmBackend::kOneDnn}) {
    if (!cpu::gemm_backend_available(b)) continue;
    cpu::set_gemm_backend(b);
    const Vecs<float> in = to_float(random_inputs(op, 4));
    Vecs<float> out = sized<float>(op.out_sizes);
    op.forward_f(in, out);
    const Vecs<double> r = loss_weights(op, 5);
    Vecs<float> grads = sized<float>(op.in_sizes);
    op.backward_f(in, out, to_float(r), grads);
    auto loss = [&](const Vecs<float>& x) {
      Vecs<float> o = sized<float>(op.out_sizes);
      op.forward_f(x, o);
      Vecs<double> od;
      for (const auto& v : o) od.emplace_back(v.begin(), v.end());
      return loss_of(op, od, r);
    };
    const float h = 1e-2f;
    for (size_t k = 0; k < in.size(); ++k) {
      const size_t n = in[k].size(), stride = std::max<size_t>(1, n / 40);
      for (size_t i = 0; i < n; i += stride) {
        Vecs<float> plus = in, minus = in;
        plus[k][i] += h;
        minus[k][i] -= h;
        const double fd = (loss(plus) - loss(minus)) / (double(plus[k][i]) - minus[k][i]);
        ASSERT_NEAR(grads[k][i], fd, 3e-3 * (1 + std::abs(fd)))
            << op.name << " (" << cpu::gemm_backend_name(b) << ") input " << k << " element " << i;
      }
    }
  }
}

// Backward adds into gradient buffers that already hold something (the
// accumulation over micro-batches and over a parameter's several uses relies
// on it): from random starting gradients, the result is start + the
// gradients computed from zero.
TEST_P(KernelTest, BackwardAddsIntoGradientsThatAreNotZero) {
  const Op op = make_ops()[GetParam()];
  if (!op.accumulates) GTEST_SKIP() << op.name << " overwrites its input's gradient by contract";
  const Vecs<double> in = random_inputs(op, 6);
  Vecs<double> out = sized<double>(op.out_sizes);
  op.forward_d(in, out);
  const Vecs<double> r = loss_weights(op, 7);
  Vecs<double> from_zero = sized<double>(op.in_sizes);
  op.backward_d(in, out, r, from_zero);
  Vecs<double> start = sized<double>(op.in_sizes);
  std::mt19937 gen(8);
  std::normal_distribution<double> dist;
  for (auto& v : start)
    for (auto& x : v) x = dist(gen);
  Vecs<double> added = start;
  op.backward_d(in, out, r, added);
  for (size_t k = 0; k < in.size(); ++k)
    for (size_t i = 0; i < in[k].size(); ++i)
      ASSERT_NEAR(added[k][i], start[k][i] + from_zero[k][i], 1e-12 * (1 + std::abs(added[k][i])))
          << op.name << " input " << k << " element " << i;
}

INSTANTIATE_TEST_SUITE_P(AllOps, KernelTest, ::testing::Range<size_t>(0, make_ops().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           std::string s = make_ops()[info.param].name;
                           for (auto& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

TEST(AdamW, MatchesReferenceOverSteps) {
  const int64_t n = 37;
  std::mt19937 gen(5);
  std::normal_distribution<double> dist;
  std::vector<float> p(n), g(n), m(n, 0), v(n, 0);
  std::vector<double> rp(n), rm(n, 0), rv(n, 0);
  for (int64_t i = 0; i < n; ++i) rp[i] = p[i] = static_cast<float>(dist(gen));
  cpu::AdamWParams hp{1e-2, 0.9, 0.95, 1e-8, 0.1, 1};
  for (int step = 1; step <= 5; ++step) {
    hp.step = step;
    for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(dist(gen));
    cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp);
    for (int64_t i = 0; i < n; ++i) {
      rm[i] = 0.9 * rm[i] + 0.1 * g[i];
      rv[i] = 0.95 * rv[i] + 0.05 * double(g[i]) * g[i];
      double mhat = rm[i] / (1 - std::pow(0.9, step)), vhat = rv[i] / (1 - std::pow(0.95, step));
      rp[i] -= 1e-2 * (mhat / (std::sqrt(vhat) + 1e-8) + 0.1 * rp[i]);
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(p[i], rp[i], 1e-5);
}

TEST(Clipping, SumSquaresAndScale) {
  std::vector<float> x(200001);
  double want = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>((i % 7) - 3) * 0.5f;
    want += double(x[i]) * x[i];
  }
  EXPECT_NEAR(cpu::sum_squares(x.data(), static_cast<int64_t>(x.size())), want, 1e-9 * want);
  cpu::scale_inplace(x.data(), static_cast<int64_t>(x.size()), 0.5f);
  EXPECT_NEAR(cpu::sum_squares(x.data(), static_cast<int64_t>(x.size())), want / 4, 1e-9 * want);
}

TEST(Dropout, KeepRateAndScale) {
  DropoutStream s(1, 2, 0.3f);
  std::vector<float> keep(100000);
  s.row(7, 9, 11, 0, static_cast<int64_t>(keep.size()), keep.data());
  int kept = 0;
  for (float k : keep) {
    ASSERT_TRUE(k == 0.0f || std::abs(k - 1.0f / 0.7f) < 1e-6);
    kept += k > 0;
  }
  EXPECT_NEAR(kept / 100000.0, 0.7, 0.01);
  // A sub-range reproduces the same mask: backward and blocked kernels rely on it.
  std::vector<float> part(40);
  s.row(7, 9, 11, 64, 104, part.data());
  for (int i = 0; i < 40; ++i) EXPECT_EQ(part[i], keep[64 + i]);
}

}  // namespace
}  // namespace loom
