// The kernels of 16-bit training against the scalar conversions of
// core/dtype.h and the f32 AdamW: rounding and widening (ties to even, NaN,
// infinities, f16 subnormals and overflow), the 16-bit sum of squares, and
// AdamW on f32 masters from 16-bit gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "loom/core/rng.h"
#include "loom/kernels/cpu/adamw.h"
#include "loom/kernels/cpu/attention.h"
#include "loom/kernels/cpu/cross_entropy.h"
#include "loom/kernels/cpu/elementwise.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/cpu/layernorm.h"
#include "loom/kernels/cpu/precision.h"

namespace loom {
namespace {

// Values across the ranges that matter: normal numbers of many scales,
// exact ties for both formats, f16 and f32 subnormals and overflow, signed zeros,
// infinities and NaN.
std::vector<float> awkward_values() {
  std::vector<float> x = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          65504.0f,                           // f16's largest
                          65520.0f,                           // rounds to infinity in f16
                          1e-7f,                              // an f16 subnormal
                          5.9604645e-8f,                      // 2^-24, f16's smallest
                          std::bit_cast<float>(0x3f808000u),  // a bf16 tie (to even: down)
                          std::bit_cast<float>(0x3f818000u),  // a bf16 tie (to even: up)
                          std::bit_cast<float>(0x3f801000u),  // an f16 tie
                          std::bit_cast<float>(0x00000001u),  // f32's smallest subnormal
                          std::bit_cast<float>(0x807fffffu),  // rounds up to bf16's -min normal
                          std::bit_cast<float>(0x00408000u),  // a subnormal bf16 tie
                          3.4e38f};
  const NormalStream rng(7, "awkward");
  for (int i = 0; i < 4000; ++i)
    x.push_back(rng.at(static_cast<uint64_t>(i)) * std::ldexp(1.0f, i % 60 - 30));
  // The special values again from element 64 on, in 32-element blocks
  // without a subnormal, where the CPU's bf16 instruction (if it has one)
  // rounds them rather than the formula.
  std::vector<float> special;
  for (int i = 0; i < 20; ++i)
    if (std::fpclassify(x[static_cast<size_t>(i)]) != FP_SUBNORMAL)
      special.push_back(x[static_cast<size_t>(i)]);
  x.insert(x.begin() + 64, special.begin(), special.end());
  return x;
}

TEST(Precision, RoundAndWidenMatchTheScalarConversions) {
  const std::vector<float> x = awkward_values();
  const int64_t n = static_cast<int64_t>(x.size());
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> r(x.size());
    std::vector<float> w(x.size());
    cpu::round_to_16(x.data(), r.data(), n, t);
    cpu::widen_16(r.data(), w.data(), n, t);
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t want = t == DType::kBF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
      ASSERT_EQ(r[i], want) << dtype_name(t) << " " << x[i];
      const float back = t == DType::kBF16 ? bf16_to_f32(want) : f16_to_f32(want);
      if (std::isnan(back))
        EXPECT_TRUE(std::isnan(w[i]));
      else
        EXPECT_EQ(std::bit_cast<uint32_t>(w[i]), std::bit_cast<uint32_t>(back));
    }
    // Ties to even and overflow, spelled out.
    if (t == DType::kBF16) {
      EXPECT_EQ(r[11], 0x3f80);
      EXPECT_EQ(r[12], 0x3f82);
    } else {
      EXPECT_EQ(r[8], 0x7c00);  // 65520: infinity
      EXPECT_EQ(r[7], 0x7bff);  // 65504
      EXPECT_EQ(r[10], 0x0001);
    }
  }
}

TEST(Precision, SumOfSquaresEqualsTheWidenedOnesBitwise) {
  // More than one of the fixed chunks (2^16), so their order shows.
  const int64_t n = (1 << 17) + 123;
  std::vector<float> x(static_cast<size_t>(n));
  const NormalStream rng(3, "x");
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = rng.at(static_cast<uint64_t>(i));
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> r(x.size());
    std::vector<float> w(x.size());
    cpu::round_to_16(x.data(), r.data(), n, t);
    cpu::widen_16(r.data(), w.data(), n, t);
    EXPECT_EQ(cpu::sum_squares_16(r.data(), n, t), cpu::sum_squares(w.data(), n)) << dtype_name(t);
  }
}

// GELU written straight into 16 bits (an MLP's record twin) is gelu_forward
// rounded, bit for bit: the twin holds what rounding the f32 output would.
TEST(Precision, GeluForward16IsGeluRoundedBitwise) {
  const int64_t n = 5 * 1024 + 77;  // pieces and a ragged end
  std::vector<float> x(static_cast<size_t>(n)), y(x.size());
  const NormalStream rng(5, "gelu");
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = 3 * rng.at(static_cast<uint64_t>(i));
  cpu::gelu_forward<float>(y.data(), x.data(), n);
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> want(x.size()), got(x.size());
    cpu::round_to_16(y.data(), want.data(), n, t);
    cpu::gelu_forward_16(got.data(), x.data(), n, t);
    EXPECT_EQ(got, want) << dtype_name(t);
  }
}

// GELU that records its input in 16 bits (the MLP's GELU input twin): the
// output is gelu_forward's (rounded, as gelu_forward_16, when it goes to
// 16 bits), the record round_to_16's, and the backward from those 16-bit
// values gelu_backward's on them widened, all bit for bit.
TEST(Precision, GeluRecord16FormsAreTheF32OnesBitwise) {
  const int64_t n = 5 * 1024 + 77;  // pieces and a ragged end
  std::vector<float> x(static_cast<size_t>(n)), d(x.size()), y(x.size());
  const NormalStream rng(6, "gelu");
  for (int64_t i = 0; i < n; ++i) {
    x[static_cast<size_t>(i)] = 3 * rng.at(static_cast<uint64_t>(i));
    d[static_cast<size_t>(i)] = rng.at(static_cast<uint64_t>(n + i));
  }
  cpu::gelu_forward<float>(y.data(), x.data(), n);
  for (DType t : {DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(t));
    std::vector<uint16_t> x16(x.size()), want_x16(x.size()), y16(x.size()), want_y16(x.size());
    std::vector<float> got_y(x.size());
    cpu::round_to_16(x.data(), want_x16.data(), n, t);
    cpu::round_to_16(y.data(), want_y16.data(), n, t);
    cpu::gelu_forward_record_16(got_y.data(), nullptr, x.data(), x16.data(), n, t);
    EXPECT_EQ(got_y, y);
    EXPECT_EQ(x16, want_x16);
    std::fill(x16.begin(), x16.end(), uint16_t{0});
    cpu::gelu_forward_record_16(nullptr, y16.data(), x.data(), x16.data(), n, t);
    EXPECT_EQ(y16, want_y16);
    EXPECT_EQ(x16, want_x16);
    std::vector<float> widened(x.size()), want(x.size()), got(x.size());
    cpu::widen_16(x16.data(), widened.data(), n, t);
    cpu::gelu_backward<float>(want.data(), widened.data(), d.data(), n);
    cpu::gelu_backward_16(got.data(), x16.data(), d.data(), n, t);
    EXPECT_EQ(got, want);
  }
}

// The cross-entropy's gradient written straight into 16 bits (what the LM
// head's bf16 GEMMs read) is cross_entropy_backward's rounded, bit for bit:
// rows longer than a piece with ragged ends, a target in the first, a middle
// and the last piece, the padding zero (a target there too), and a
// vocabulary-parallel slice (v0) with targets before and past it.
TEST(Precision, CrossEntropyBackward16IsTheGradientRoundedBitwise) {
  for (const auto& [V, Vp, v0] : {std::tuple<int64_t, int64_t, int64_t>{50, 64, 0},
                                  {3 * 1024 + 77, 3 * 1024 + 128, 0},
                                  {2 * 1024 + 5, 2 * 1024 + 8, 1000}}) {
    const std::vector<int64_t> local = {0, V / 2, 1024 + 3, V - 5, V - 1, V + 1, -1, Vp + 7};
    const auto N = static_cast<int64_t>(local.size());
    std::vector<float> logits(static_cast<size_t>(N * Vp)), lse(N), losses(N), dloss(N);
    std::vector<int32_t> targets(N);
    const NormalStream rng(11, "cross_entropy");
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = 3 * rng.at(i);
    for (int64_t n = 0; n < N; ++n) {
      targets[n] = static_cast<int32_t>(v0 + std::min(local[n], Vp + 7));
      dloss[n] = 1.0f / float(N) * (1 + 0.1f * float(n));
    }
    const std::vector<int32_t> first(N, 0);  // lse does not depend on the targets
    cpu::cross_entropy_forward<float>(losses.data(), lse.data(), logits.data(), first.data(), N, V,
                                      Vp);
    std::vector<float> grad = logits;
    cpu::cross_entropy_backward<float>(grad.data(), lse.data(), targets.data(), dloss.data(), N, V,
                                       Vp, v0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t v = V; v < Vp; ++v) ASSERT_EQ(grad[n * Vp + v], 0.0f) << "padding " << n;
    for (DType t : {DType::kBF16, DType::kF16}) {
      std::vector<uint16_t> want(grad.size()), got(grad.size(), 0xffff);
      cpu::round_to_16(grad.data(), want.data(), N * Vp, t);
      const std::vector<float> before = logits;
      cpu::cross_entropy_backward_16(got.data(), logits.data(), lse.data(), targets.data(),
                                     dloss.data(), N, V, Vp, v0, t);
      EXPECT_EQ(got, want) << dtype_name(t) << " V " << V << " v0 " << v0;
      EXPECT_EQ(logits, before) << "the logits are only read";
    }
  }
}

// A LayerNorm written straight into 16 bits (the record twin of the
// attention's or the MLP's input) is layernorm_forward rounded, bit for
// bit, with the same statistics: rows longer than a piece, ragged ends.
TEST(Precision, LayerNormForward16IsLayerNormRoundedBitwise) {
  for (const int64_t C : {int64_t{7}, int64_t{512}, int64_t{2 * 1024 + 37}}) {
    const int64_t N = 5;
    std::vector<float> x(static_cast<size_t>(N * C)), w(static_cast<size_t>(C)),
        b(static_cast<size_t>(C)), y(x.size()), mean(5), rstd(5), mean16(5), rstd16(5);
    const NormalStream rng(7, "layernorm");
    for (size_t i = 0; i < x.size(); ++i) x[i] = 2 + 3 * rng.at(i);
    for (size_t c = 0; c < w.size(); ++c) {
      w[c] = 1 + 0.2f * rng.at(x.size() + c);
      b[c] = 0.1f * rng.at(x.size() + w.size() + c);
    }
    cpu::layernorm_forward<float>(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(),
                                  N, C);
    for (DType t : {DType::kBF16, DType::kF16}) {
      std::vector<uint16_t> want(x.size()), got(x.size());
      cpu::round_to_16(y.data(), want.data(), N * C, t);
      cpu::layernorm_forward_16(got.data(), mean16.data(), rstd16.data(), x.data(), w.data(),
                                b.data(), N, C, t);
      EXPECT_EQ(got, want) << dtype_name(t) << " C " << C;
      EXPECT_EQ(mean16, mean) << dtype_name(t) << " C " << C;
      EXPECT_EQ(rstd16, rstd) << dtype_name(t) << " C " << C;
    }
  }
}

// The attention core's 16-bit forms (Backend::attention_forward_16 and
// attention_backward_16 on the CPU): forward writes q|k|v's bf16 rows bit
// for bit round_to_16's and leaves its outputs as attention_forward's;
// backward from the bf16 rows is bit for bit attention_backward of them
// widened. Both with f32 GEMMs and with bf16 tiles on the bf16 matmul (the
// core's own rounded tiles then go straight into and out of the rows),
// with and without dropout, T past one 64-row query block.
TEST(Precision, Attention16FormsAreTheF32OnesOnRoundedQkvBitwise) {
  const int64_t B = 2, T = 70, C = 32, NH = 2, n = B * T * 3 * C;
  std::mt19937 gen(21);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> qkv(static_cast<size_t>(n)), dy(static_cast<size_t>(B * T * C));
  for (float& x : qkv) x = dist(gen);
  for (float& x : dy) x = dist(gen);
  std::vector<cpu::GemmConfig> configs = {cpu::GemmConfig{}};
  if (cpu::gemm_16_uses_bf16_matmul(DType::kBF16))
    configs.push_back(cpu::GemmConfig{cpu::GemmBackend::kOneDnn, DType::kBF16});
  for (const cpu::GemmConfig& g : configs)
    for (const float p : {0.0f, 0.2f}) {
      SCOPED_TRACE(::testing::Message()
                   << "bf16 inputs " << (g.inputs == DType::kBF16) << " p " << p);
      const DropoutStream stream(5, 1, p);
      const DropoutSpec drop{&stream, 3, dropout_site(0, DropoutSite::kAttnProbs)};
      std::vector<float> y(static_cast<size_t>(B * T * C)), lse(static_cast<size_t>(B * NH * T));
      std::vector<float> y16 = y, lse16 = lse;
      std::vector<uint16_t> rows(static_cast<size_t>(n)), want_rows(static_cast<size_t>(n));
      cpu::attention_forward<float>(g, y.data(), lse.data(), qkv.data(), B, T, C, NH, drop);
      cpu::attention_forward<float>(g, y16.data(), lse16.data(), qkv.data(), B, T, C, NH, drop,
                                    rows.data());
      cpu::round_to_16(qkv.data(), want_rows.data(), n, DType::kBF16);
      EXPECT_EQ(rows, want_rows);
      EXPECT_EQ(y16, y);
      EXPECT_EQ(lse16, lse);
      std::vector<float> widened(static_cast<size_t>(n));
      cpu::widen_16(rows.data(), widened.data(), n, DType::kBF16);
      std::vector<float> want(static_cast<size_t>(n), 7.0f), got(static_cast<size_t>(n), -7.0f);
      cpu::attention_backward<float>(g, want.data(), dy.data(), widened.data(), y.data(),
                                     lse.data(), B, T, C, NH, drop);
      cpu::attention_backward<float>(g, got.data(), dy.data(), nullptr, y.data(), lse.data(), B, T,
                                     C, NH, drop, rows.data());
      EXPECT_EQ(got, want);
    }
}

TEST(Precision, AdamWOnMastersIsTheF32UpdateThenRounded) {
  const int64_t n = 5000;
  const NormalStream rng(11, "adamw");
  std::vector<float> master(n), m(n), v(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    master[i] = 0.05f * rng.at(static_cast<uint64_t>(i));
    m[i] = 1e-3f * rng.at(static_cast<uint64_t>(n + i));
    v[i] = 1e-6f * std::abs(rng.at(static_cast<uint64_t>(2 * n + i)));
    g[i] = 1e-2f * rng.at(static_cast<uint64_t>(3 * n + i));
  }
  AdamWParams hp;
  hp.lr = 3e-4, hp.beta1 = 0.9, hp.beta2 = 0.95, hp.eps = 1e-8, hp.weight_decay = 0.1, hp.step = 7;
  const float scale = 0.25f;  // clipping and 1 / loss scale
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> g16(n), p16(n);
    cpu::round_to_16(g.data(), g16.data(), n, t);
    // The reference: the f32 update on the widened, scaled gradients.
    std::vector<float> want_master = master, want_m = m, want_v = v, gw(n);
    cpu::widen_16(g16.data(), gw.data(), n, t);
    for (float& x : gw) x *= scale;
    cpu::adamw_update(want_master.data(), gw.data(), want_m.data(), want_v.data(), n, hp);
    std::vector<float> got_master = master, got_m = m, got_v = v;
    cpu::adamw_update_16(got_master.data(), g16.data(), scale, got_m.data(), got_v.data(),
                         p16.data(), n, t, hp);
    EXPECT_EQ(got_master, want_master) << dtype_name(t);
    EXPECT_EQ(got_m, want_m) << dtype_name(t);
    EXPECT_EQ(got_v, want_v) << dtype_name(t);
    std::vector<uint16_t> want_p(n);
    cpu::round_to_16(want_master.data(), want_p.data(), n, t);
    EXPECT_EQ(p16, want_p) << dtype_name(t);
  }
}

// Gradients added into 16-bit accumulators (f32 or 16-bit addends, scaled),
// and 16-bit values scaled: each element widened, added in f32, rounded
// once, bit for bit as the scalar conversions do it, over more elements than
// one of the kernels' pieces and a ragged tail.
TEST(Precision, AccumulateAndScaleRoundOnceBitwise) {
  const int64_t n = 2 * 1024 + 13;
  const NormalStream rng(3, "accumulate");
  std::vector<float> x(n), a(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = rng.at(static_cast<uint64_t>(i)) * std::ldexp(1.0f, int(i % 20) - 10);
    a[i] = rng.at(static_cast<uint64_t>(n + i));
  }
  for (DType t : {DType::kBF16, DType::kF16}) {
    auto wid = [t](uint16_t v) { return t == DType::kBF16 ? bf16_to_f32(v) : f16_to_f32(v); };
    auto nar = [t](float v) { return t == DType::kBF16 ? f32_to_bf16(v) : f32_to_f16(v); };
    std::vector<uint16_t> acc(n), x16(n), want(n);
    cpu::round_to_16(a.data(), acc.data(), n, t);
    cpu::round_to_16(x.data(), x16.data(), n, t);
    std::vector<uint16_t> got = acc;
    cpu::accumulate_16(x.data(), 0.5f, got.data(), n, t);
    for (int64_t i = 0; i < n; ++i) want[i] = nar(wid(acc[i]) + x[i] * 0.5f);
    EXPECT_EQ(got, want) << dtype_name(t) << " f32 addends";
    got = acc;
    cpu::accumulate_16(x16.data(), 0.25f, got.data(), n, t);
    for (int64_t i = 0; i < n; ++i) want[i] = nar(wid(acc[i]) + wid(x16[i]) * 0.25f);
    EXPECT_EQ(got, want) << dtype_name(t) << " 16-bit addends";
    got = acc;
    cpu::scale_16(got.data(), n, 0.75f, t);
    for (int64_t i = 0; i < n; ++i) want[i] = nar(wid(acc[i]) * 0.75f);
    EXPECT_EQ(got, want) << dtype_name(t) << " scaled";
    EXPECT_FALSE(cpu::any_nonfinite_16(got.data(), n, t));
    got[n - 1] = t == DType::kBF16 ? 0xff80 : 0xfc00;  // -inf
    EXPECT_TRUE(cpu::any_nonfinite_16(got.data(), n, t));
  }
}

}  // namespace
}  // namespace loom
