// One table drives the test of every backend (kernels/backend.h): each
// operation of the table runs on each backend of the list and is checked
//   (1) in f32 against the reference backend in double (f32 alone for the
//       16-bit operations);
//   (2) backward in double against central finite differences of the same
//       backend's forward, L = sum_o <out_o, r_o> with random r;
//   (3) backward in f32 against finite differences of its own f32 forward
//       (the kernels that train: GEMM libraries, vectorised exp and tanh);
//   (4) backward adding into gradients that already hold values.
// A new backend is tested by adding one line to backends(); a new operation
// by adding it to the table (CoversEveryOperation fails until then).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend_op_cases.h"
#include "loom/core/error.h"
#include "loom/kernels/backend.h"
#include "loom/kernels/cpu/cpu_backend.h"
#include "loom/kernels/reference/reference_backend.h"
#ifdef LOOM_HAVE_CUDA
#include "loom/kernels/cuda/cuda_backend.h"
#endif

namespace loom {
namespace {

using namespace backend_test;

// --- the backends ------------------------------------------------------------

struct BackendCase {
  std::string name;
  std::shared_ptr<const Backend<float>> f32;
  std::shared_ptr<const Backend<double>> f64;
};

std::vector<BackendCase> backends() {
  using cpu::GemmBackend;
  std::vector<BackendCase> b;
  b.push_back({"reference", std::make_shared<ReferenceBackend<float>>(),
               std::make_shared<ReferenceBackend<double>>()});
  b.push_back({"cpu_openblas", std::make_shared<CpuBackend<float>>(),
               std::make_shared<CpuBackend<double>>()});
  if (cpu::gemm_backend_available(GemmBackend::kOneDnn))
    b.push_back({"cpu_onednn",
                 std::make_shared<CpuBackend<float>>(cpu::GemmConfig{GemmBackend::kOneDnn}),
                 std::make_shared<CpuBackend<double>>(cpu::GemmConfig{GemmBackend::kOneDnn})});
#ifdef LOOM_HAVE_CUDA
  // The CUDA backend where this machine has a GPU: it stages the harness's
  // host vectors through device memory itself.
  std::string why;
  if (cuda_device_count(&why) > 0)
    b.push_back(
        {"cuda", std::make_shared<CudaBackend<float>>(), std::make_shared<CudaBackend<double>>()});
  else
    std::printf("loom_backend_tests: the CUDA backend is built but not tested: %s\n", why.c_str());
#endif
  return b;
}

const std::vector<OpCase>& all_ops() {
  static const std::vector<OpCase> ops = make_ops();
  return ops;
}
const std::vector<BackendCase>& all_backends() {
  static const std::vector<BackendCase> b = backends();
  return b;
}

// --- the checks ----------------------------------------------------------------

double loss_of(const OpCase& op, const Vecs<double>& out, const Vecs<double>& r) {
  double L = 0;
  for (size_t o = 0; o < out.size(); ++o)
    if (op.compared[o])
      for (size_t i = 0; i < out[o].size(); ++i) L += out[o][i] * r[o][i];
  return L;
}

Vecs<double> loss_weights(const OpCase& op, uint32_t seed) {
  Vecs<double> r = sized<double>(op.out_sizes);
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist;
  for (size_t o = 0; o < r.size(); ++o)
    if (op.compared[o])
      for (auto& x : r[o]) x = dist(gen);
  return r;
}

bool close(double got, double want, double tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::abs(got - want) <= tol * (1 + std::abs(want));
}

using Param = std::tuple<size_t, size_t>;  // (backend, op)

class BackendOps : public ::testing::TestWithParam<Param> {
 protected:
  const BackendCase& backend_case() const { return all_backends()[std::get<0>(GetParam())]; }
  const OpCase& op_case() const { return all_ops()[std::get<1>(GetParam())]; }
};

// The operations with a backward: the gradient checks run on these.
class BackendGrads : public BackendOps {};

TEST_P(BackendOps, ForwardMatchesTheReference) {
  const BackendCase& b = backend_case();
  const OpCase& op = op_case();
  for (Op o : op.covers) ASSERT_TRUE(b.f32->supports(o)) << b.name << " " << op_name(o);
  const Vecs<double> in = random_inputs(op, 1);
  Vecs<double> want = sized<double>(op.out_sizes);
  if (op.fwd_d) {
    op.fwd_d(ReferenceBackend<double>(), in, want);
  } else {
    Vecs<float> w = sized<float>(op.out_sizes);
    op.fwd_f(ReferenceBackend<float>(), convert<float>(in), w);
    for (size_t o = 0; o < w.size(); ++o) want[o].assign(w[o].begin(), w[o].end());
  }
  Vecs<float> got = sized<float>(op.out_sizes);
  op.fwd_f(*b.f32, convert<float>(in), got);
  // An f32 result is at best the double one rounded.
  const double tol = std::max(op.fwd_tol, op.fwd_d ? 1e-7 : 0.0);
  for (size_t o = 0; o < want.size(); ++o) {
    if (!op.compared[o]) continue;
    for (size_t i = 0; i < want[o].size(); ++i)
      ASSERT_PRED3(close, got[o][i], want[o][i], tol)
          << op.name << " on " << b.name << ": output " << o << " element " << i;
  }
}

TEST_P(BackendGrads, BackwardMatchesFiniteDifferencesInF64) {
  const BackendCase& b = backend_case();
  const OpCase& op = op_case();
  const Backend<double>& be = *b.f64;
  const Vecs<double> in = random_inputs(op, 2);
  Vecs<double> out = sized<double>(op.out_sizes);
  op.fwd_d(be, in, out);
  // In double the forward equals the reference's to rounding.
  Vecs<double> want = sized<double>(op.out_sizes);
  op.fwd_d(ReferenceBackend<double>(), in, want);
  for (size_t o = 0; o < out.size(); ++o) {
    if (!op.compared[o]) continue;
    for (size_t i = 0; i < out[o].size(); ++i)
      ASSERT_NEAR(out[o][i], want[o][i], 1e-9 * (1 + std::abs(want[o][i]))) << op.name;
  }
  const Vecs<double> r = loss_weights(op, 3);
  Vecs<double> grads = sized<double>(op.in_sizes);
  op.bwd_d(be, in, out, r, grads);
  const double h = 1e-6;
  for (size_t k = 0; k < in.size(); ++k) {
    const size_t n = in[k].size(), stride = std::max<size_t>(1, n / 40);  // ~40 probes an input
    for (size_t i = 0; i < n; i += stride) {
      Vecs<double> plus = in, minus = in;
      plus[k][i] += h;
      minus[k][i] -= h;
      Vecs<double> op_out = sized<double>(op.out_sizes), om_out = sized<double>(op.out_sizes);
      op.fwd_d(be, plus, op_out);
      op.fwd_d(be, minus, om_out);
      const double fd = (loss_of(op, op_out, r) - loss_of(op, om_out, r)) / (2 * h);
      ASSERT_NEAR(grads[k][i], fd, 1e-5 * (1 + std::abs(fd)))
          << op.name << " on " << b.name << ": input " << k << " element " << i;
    }
  }
}

// h = 1e-2 on inputs O(1): truncation O(h^2) ~ 1e-4 and f32 rounding of the
// loss / 2h ~ 1e-4, so 3e-3 (1 + |fd|) holds while a wrong factor or a
// missing term (O(1)) does not.
TEST_P(BackendGrads, BackwardMatchesFiniteDifferencesInF32) {
  const BackendCase& b = backend_case();
  const OpCase& op = op_case();
  const Backend<float>& be = *b.f32;
  const Vecs<float> in = convert<float>(random_inputs(op, 4));
  Vecs<float> out = sized<float>(op.out_sizes);
  op.fwd_f(be, in, out);
  const Vecs<double> r = loss_weights(op, 5);
  Vecs<float> grads = sized<float>(op.in_sizes);
  op.bwd_f(be, in, out, convert<float>(r), grads);
  auto loss = [&](const Vecs<float>& x) {
    Vecs<float> o = sized<float>(op.out_sizes);
    op.fwd_f(be, x, o);
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
          << op.name << " on " << b.name << ": input " << k << " element " << i;
    }
  }
}

// The accumulation over micro-batches and over a parameter's several uses
// relies on it: from random starting gradients, backward gives start + the
// gradients computed from zero; and the layers that no longer zero-fill a
// scratch gradient rely on the inputs written over (OpCase::sets) being the
// gradients from zero, whatever the buffer held.
TEST_P(BackendGrads, BackwardAddsIntoGradientsOrWritesThemOver) {
  const BackendCase& b = backend_case();
  const OpCase& op = op_case();
  const Backend<double>& be = *b.f64;
  const Vecs<double> in = random_inputs(op, 6);
  Vecs<double> out = sized<double>(op.out_sizes);
  op.fwd_d(be, in, out);
  const Vecs<double> r = loss_weights(op, 7);
  Vecs<double> from_zero = sized<double>(op.in_sizes);
  op.bwd_d(be, in, out, r, from_zero);
  Vecs<double> start = sized<double>(op.in_sizes);
  std::mt19937 gen(8);
  std::normal_distribution<double> dist;
  for (auto& v : start)
    for (auto& x : v) x = dist(gen);
  Vecs<double> added = start;
  op.bwd_d(be, in, out, r, added);
  for (size_t k = 0; k < in.size(); ++k)
    for (size_t i = 0; i < in[k].size(); ++i)
      ASSERT_NEAR(added[k][i], (op.sets_input(k) ? 0.0 : start[k][i]) + from_zero[k][i],
                  1e-12 * (1 + std::abs(added[k][i])))
          << op.name << " on " << b.name << ": input " << k << " element " << i
          << (op.sets_input(k) ? " (written over)" : " (added)");
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  std::string s =
      all_backends()[std::get<0>(info.param)].name + "_" + all_ops()[std::get<1>(info.param)].name;
  for (auto& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

std::vector<size_t> differentiable_ops() {
  std::vector<size_t> k;
  for (size_t i = 0; i < all_ops().size(); ++i)
    if (all_ops()[i].bwd_d) k.push_back(i);
  return k;
}

INSTANTIATE_TEST_SUITE_P(Table, BackendOps,
                         ::testing::Combine(::testing::Range<size_t>(0, all_backends().size()),
                                            ::testing::Range<size_t>(0, all_ops().size())),
                         param_name);
INSTANTIATE_TEST_SUITE_P(Table, BackendGrads,
                         ::testing::Combine(::testing::Range<size_t>(0, all_backends().size()),
                                            ::testing::ValuesIn(differentiable_ops())),
                         param_name);

// --- the table itself ------------------------------------------------------------

TEST(BackendTable, CoversEveryOperation) {
  std::vector<bool> covered(kNumOps, false);
  for (const OpCase& op : all_ops())
    for (Op o : op.covers) covered[static_cast<size_t>(o)] = true;
  for (int i = 0; i < kNumOps; ++i)
    EXPECT_TRUE(covered[static_cast<size_t>(i)])
        << op_name(static_cast<Op>(i)) << " has no entry in the table";
}

TEST(BackendTable, SixteenBitOperationsAreF32Only) {
  for (const BackendCase& b : all_backends()) {
    for (int i = 0; i < kNumOps; ++i) EXPECT_TRUE(b.f32->supports(static_cast<Op>(i))) << b.name;
    for (Op o : {Op::kRound16, Op::kWiden16, Op::kAdamW16, Op::kAccumulate16, Op::kSumSquares16,
                 Op::kScale16, Op::kNonfinite16, Op::kGeluForward16, Op::kGeluForwardRecord16,
                 Op::kGeluBackward16, Op::kLayerNormForward16, Op::kCrossEntropyBackward16,
                 Op::kAttentionForward16, Op::kAttentionBackward16})
      EXPECT_FALSE(b.f64->supports(o)) << b.name << " " << op_name(o);
    EXPECT_TRUE(b.f64->supports(Op::kAttentionBackward)) << b.name;
    // What a backend lacks says so, by name.
    float x = 1.0f;
    uint16_t h = 0;
    try {
      b.f64->round_16(&x, &h, 1, DType::kBF16);
      ADD_FAILURE() << b.name << ": round_16 in f64 did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
      EXPECT_NE(std::string(e.what()).find("does not support round_16 in f64"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(b.f64->name()), std::string::npos) << e.what();
    }
  }
}

// Two CPU backends with different GEMM settings side by side: nothing about
// the choice is process-wide.
TEST(BackendTable, GemmSettingsBelongToTheBackend) {
  const int64_t M = 4, N = 5, K = 300;
  std::vector<float> A(M * K), B(K * N), c32(M * N), c16(M * N), again(M * N);
  std::mt19937 gen(1);
  std::normal_distribution<float> dist;
  for (auto& x : A) x = dist(gen);
  for (auto& x : B) x = dist(gen);
  const CpuBackend<float> f32, bf16(cpu::GemmConfig{cpu::GemmBackend::kOpenBlas, DType::kBF16});
  f32.gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, c32.data(), N);
  bf16.gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, c16.data(), N);
  f32.gemm(false, false, M, N, K, 1.0f, A.data(), K, B.data(), N, 0.0f, again.data(), N);
  EXPECT_EQ(c32, again) << "the bf16 backend changed the f32 one";
  EXPECT_NE(c32, c16) << "bf16 inputs were not rounded";
  for (size_t i = 0; i < c32.size(); ++i) EXPECT_NEAR(c16[i], c32[i], 0.05 * std::sqrt(K));
  EXPECT_EQ(f32.name(), "cpu (openblas)");
  EXPECT_EQ(bf16.name(), "cpu (openblas, bf16 GEMM inputs)");
  if (!cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn)) {
    try {
      CpuBackend<float> none(cpu::GemmConfig{cpu::GemmBackend::kOneDnn});
      ADD_FAILURE() << "a backend without oneDNN in the build was made";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    }
  }
}

TEST(BackendTable, AllocationsAreTrackedOnTheBackendsDevice) {
  for (const BackendCase& b : all_backends()) {
    const int k = static_cast<int>(MemCategory::kActivations);
    const size_t before = memory_tracker().stats().current[k];
    {
      Buffer buf = b.f32->alloc(4096, MemCategory::kActivations);
      EXPECT_EQ(buf.device(), b.f32->device());
      EXPECT_EQ(buf.bytes(), 4096u);
      EXPECT_EQ(memory_tracker().stats().current[k], before + 4096);
      for (size_t i = 0; i < 1024; ++i) ASSERT_EQ(buf.as<float>()[i], 0.0f) << "not zeroed";
    }
    EXPECT_EQ(memory_tracker().stats().current[k], before);
  }
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

// A row's masks are what DropoutStream documents for every element (word
// c % 4 of philox4x32 on (sample low, site, position, sample high << 18 +
// c / 4) against the threshold), whichever way row() computes them: whole
// rows and sub-ranges starting on any multiple of 4, ragged ends, a sample
// past 2^32, in f32 and f64.
TEST(Dropout, MasksAreTheDocumentedPhiloxWords) {
  const DropoutStream s(42, 7, 0.1f);
  const uint64_t sample = (uint64_t{3} << 32) + 17;
  const uint32_t site = dropout_site(5, DropoutSite::kAttnProbs, 3), position = 200;
  const int64_t C = 1000;
  std::vector<float> want(static_cast<size_t>(C));
  for (int64_t c = 0; c < C; ++c) {
    const auto r =
        philox4x32({static_cast<uint32_t>(sample), site, position,
                    (static_cast<uint32_t>(sample >> 32) << 18) + static_cast<uint32_t>(c / 4)},
                   s.key());
    want[static_cast<size_t>(c)] =
        r[static_cast<size_t>(c % 4)] >= s.threshold() ? 1.0f / (1.0f - 0.1f) : 0.0f;
  }
  for (const auto& [b, e] : {std::pair<int64_t, int64_t>{0, C}, {4, 68}, {64, 999}, {8, 9}}) {
    std::vector<float> got(static_cast<size_t>(e - b), -1.0f);
    std::vector<double> got64(got.size(), -1.0);
    s.row(sample, site, position, b, e, got.data());
    s.row(sample, site, position, b, e, got64.data());
    for (int64_t c = b; c < e; ++c) {
      ASSERT_EQ(got[static_cast<size_t>(c - b)], want[static_cast<size_t>(c)]) << c << " in " << b;
      ASSERT_EQ(float(got64[static_cast<size_t>(c - b)]) != 0, want[static_cast<size_t>(c)] != 0)
          << c << " in " << b << " (f64)";
    }
  }
}

// Context parallelism's chunk kernels, composed over a sequence cut into
// chunks and merged in a scrambled order, give the whole-sequence attention
// and its gradient (with dropout: the same masks), on every backend.
TEST(AttentionChunks, ComposeToWholeSequenceAttention) {
  const int64_t B = 2, Tn = 40, C = 16, NH = 2;
  std::mt19937 rng(5);
  std::normal_distribution<double> n01(0, 1);
  std::vector<double> qkv(B * Tn * 3 * C), dout(B * Tn * C);
  for (double& x : qkv) x = n01(rng);
  for (double& x : dout) x = n01(rng);
  const DropoutStream stream(3, 1, 0.2f);
  const DropoutSpec drop{&stream, 2, dropout_site(1, DropoutSite::kAttnProbs)};
  const CpuBackend<double> cpu;
  const ReferenceBackend<double> ref;
  for (const Backend<double>* be :
       {static_cast<const Backend<double>*>(&cpu), static_cast<const Backend<double>*>(&ref)}) {
    for (int64_t Tc : {5, 10, 20}) {
      std::vector<double> out(B * Tn * C), lse(B * NH * Tn), out1(out.size()), lse1(lse.size());
      std::vector<double> g(qkv.size(), 0.0), g1(qkv.size(), 0.0);
      be->attention_forward(out1.data(), lse1.data(), qkv.data(), B, Tn, C, NH, drop);
      be->attention_backward(g1.data(), dout.data(), qkv.data(), out1.data(), lse1.data(), B, Tn, C,
                             NH, drop);
      backend_test::chunked_attention(*be, out.data(), lse.data(), qkv.data(), B, Tn, C, NH, Tc,
                                      drop);
      backend_test::chunked_attention_backward(*be, g.data(), dout.data(), qkv.data(), out.data(),
                                               lse.data(), B, Tn, C, NH, Tc, drop);
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_NEAR(out[i], out1[i], 1e-12) << be->name() << " chunk " << Tc << " out " << i;
      for (size_t i = 0; i < lse.size(); ++i)
        ASSERT_NEAR(lse[i], lse1[i], 1e-12) << be->name() << " chunk " << Tc << " lse " << i;
      for (size_t i = 0; i < g.size(); ++i)
        ASSERT_NEAR(g[i], g1[i], 1e-11) << be->name() << " chunk " << Tc << " grad " << i;
    }
  }
}

// A sequence longer than the CPU kernel's key block (512 keys): the
// blocks' online softmax merges to the reference's one softmax over every
// key, values and gradients, whole and in context-parallel chunks that span
// more than one key block, with and without dropout.
TEST(AttentionChunks, KeyBlocksMergeLikeOneSoftmax) {
  const int64_t B = 1, Tn = 1100, C = 16, NH = 2, Tc = 550;
  std::mt19937 rng(8);
  std::normal_distribution<double> n01(0, 1);
  std::vector<double> qkv(B * Tn * 3 * C), dout(B * Tn * C);
  for (double& x : qkv) x = 2 * n01(rng);  // peaked rows: the running maxima move
  for (double& x : dout) x = n01(rng);
  const CpuBackend<double> cpu;
  const ReferenceBackend<double> ref;
  for (float p : {0.0f, 0.2f}) {
    const DropoutStream stream(4, 2, p);
    const DropoutSpec drop{&stream, 1, dropout_site(0, DropoutSite::kAttnProbs)};
    std::vector<double> want(B * Tn * C), want_lse(B * NH * Tn), want_g(qkv.size(), 0.0);
    ref.attention_forward(want.data(), want_lse.data(), qkv.data(), B, Tn, C, NH, drop);
    ref.attention_backward(want_g.data(), dout.data(), qkv.data(), want.data(), want_lse.data(), B,
                           Tn, C, NH, drop);
    for (const bool chunked : {false, true}) {
      std::vector<double> out(want.size()), lse(want_lse.size()), g(qkv.size(), 0.0);
      if (chunked) {
        backend_test::chunked_attention(cpu, out.data(), lse.data(), qkv.data(), B, Tn, C, NH, Tc,
                                        drop);
        backend_test::chunked_attention_backward(cpu, g.data(), dout.data(), qkv.data(), out.data(),
                                                 lse.data(), B, Tn, C, NH, Tc, drop);
      } else {
        cpu.attention_forward(out.data(), lse.data(), qkv.data(), B, Tn, C, NH, drop);
        cpu.attention_backward(g.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, Tn, C,
                               NH, drop);
      }
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_NEAR(out[i], want[i], 1e-12) << "p " << p << " chunked " << chunked << " out " << i;
      for (size_t i = 0; i < lse.size(); ++i)
        ASSERT_NEAR(lse[i], want_lse[i], 1e-12)
            << "p " << p << " chunked " << chunked << " lse " << i;
      for (size_t i = 0; i < g.size(); ++i)
        ASSERT_NEAR(g[i], want_g[i], 1e-10) << "p " << p << " chunked " << chunked << " grad " << i;
    }
  }
}

// The CPU backend with bf16 GEMM inputs: attention's block products round
// their operands (on the bf16 matmul, q, k, v and dO once per head), so
// values and gradients follow the f32 backend's to bf16's precision and
// differ from them; whole and in context-parallel chunks past one key block.
TEST(AttentionChunks, Bf16BlockProductsFollowF32) {
  const int64_t B = 2, Tn = 1200, C = 32, NH = 2, Tc = 600;
  std::mt19937 rng(12);
  std::normal_distribution<float> n01(0, 1);
  std::vector<float> qkv(B * Tn * 3 * C), dout(B * Tn * C);
  for (float& x : qkv) x = n01(rng);
  for (float& x : dout) x = n01(rng);
  const DropoutStream stream(6, 1, 0.1f);
  const DropoutSpec drop{&stream, 3, dropout_site(1, DropoutSite::kAttnProbs)};
  const CpuBackend<float> f32;
  const CpuBackend<float> bf16(cpu::GemmConfig{cpu::GemmBackend::kOneDnn, DType::kBF16});
  struct Got {
    std::vector<float> out, lse, g;
  };
  auto run = [&](const CpuBackend<float>& be, bool chunked) {
    Got r{std::vector<float>(dout.size()), std::vector<float>(B * NH * Tn),
          std::vector<float>(qkv.size(), 0.0f)};
    if (chunked) {
      backend_test::chunked_attention(be, r.out.data(), r.lse.data(), qkv.data(), B, Tn, C, NH, Tc,
                                      drop);
      backend_test::chunked_attention_backward(be, r.g.data(), dout.data(), qkv.data(),
                                               r.out.data(), r.lse.data(), B, Tn, C, NH, Tc, drop);
    } else {
      be.attention_forward(r.out.data(), r.lse.data(), qkv.data(), B, Tn, C, NH, drop);
      be.attention_backward(r.g.data(), dout.data(), qkv.data(), r.out.data(), r.lse.data(), B, Tn,
                            C, NH, drop);
    }
    return r;
  };
  auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i)
      num += double(a[i] - b[i]) * (a[i] - b[i]), den += double(b[i]) * b[i];
    return std::sqrt(num / den);
  };
  for (const bool chunked : {false, true}) {
    const Got want = run(f32, chunked), got = run(bf16, chunked);
    for (auto [name, a, b] :
         {std::tuple{"out", &got.out, &want.out}, std::tuple{"lse", &got.lse, &want.lse},
          std::tuple{"grad", &got.g, &want.g}}) {
      const double e = rel(*a, *b);
      EXPECT_LT(e, 2e-2) << name << " chunked " << chunked;
      EXPECT_GT(e, 1e-5) << name << " chunked " << chunked << ": bf16 inputs not rounded";
    }
  }
}

}  // namespace
}  // namespace loom
