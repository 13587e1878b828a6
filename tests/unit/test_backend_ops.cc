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
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/kernels/backend.h"
#include "loom/kernels/cpu/cpu_backend.h"
#include "loom/kernels/reference/reference_backend.h"

namespace loom {
namespace {

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
  return b;
}

// --- the operations ----------------------------------------------------------

template <typename T>
using Vecs = std::vector<std::vector<T>>;
template <typename T>
using Forward = std::function<void(const Backend<T>&, const Vecs<T>&, Vecs<T>&)>;
// (backend, inputs, forward's outputs, gradients of the outputs) -> gradients
// of the inputs, added into g.
template <typename T>
using Backward = std::function<void(const Backend<T>&, const Vecs<T>&, const Vecs<T>&,
                                    const Vecs<T>&, Vecs<T>&)>;

struct OpCase {
  std::string name;
  std::vector<Op> covers;  // the backend operations it runs
  std::vector<int64_t> in_sizes, out_sizes;
  std::vector<bool> compared;  // per output: checked, and part of the loss
  Forward<float> fwd_f;
  Forward<double> fwd_d;  // null: an f32-only (16-bit) operation
  Backward<float> bwd_f;  // null: not differentiable, values only
  Backward<double> bwd_d;
  double fwd_tol = 2e-5;
  bool accumulates = true;  // backward adds into the input gradients
  std::function<void(Vecs<double>&)> adjust_inputs;
};

template <typename F>
void set_forward(OpCase& op, F f) {
  op.fwd_f = f;
  op.fwd_d = f;
}
// The 16-bit operations exist for f32 alone.
template <typename F>
void set_forward_f32(OpCase& op, F f) {
  op.fwd_f = f;
}
template <typename F>
void set_backward(OpCase& op, F f) {
  op.bwd_f = f;
  op.bwd_d = f;
}

OpCase make_case(std::string name, std::vector<Op> covers, std::vector<int64_t> in,
                 std::vector<int64_t> out, std::vector<bool> compared) {
  OpCase op;
  op.name = std::move(name);
  op.covers = std::move(covers);
  op.in_sizes = std::move(in);
  op.out_sizes = std::move(out);
  op.compared = std::move(compared);
  return op;
}

template <typename T>
Vecs<T> sized(const std::vector<int64_t>& sizes) {
  Vecs<T> v;
  for (int64_t n : sizes) v.emplace_back(static_cast<size_t>(n), T(0));
  return v;
}

template <typename T>
Vecs<T> convert(const Vecs<double>& v) {
  Vecs<T> f;
  for (const auto& x : v) f.emplace_back(x.begin(), x.end());
  return f;
}

Vecs<double> random_inputs(const OpCase& op, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  Vecs<double> in = sized<double>(op.in_sizes);
  for (auto& v : in)
    for (auto& x : v) x = dist(gen);
  if (op.adjust_inputs) op.adjust_inputs(in);
  return in;
}

std::vector<int32_t> make_tokens(int64_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(gen() % static_cast<uint32_t>(vocab));
  return t;
}

// 16-bit values as the operations take them: x rounded to t (the rounding
// itself is tested apart), and back.
std::vector<uint16_t> to_16(const std::vector<float>& x, DType t) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    h[i] = t == DType::kBF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
  return h;
}
void from_16(const std::vector<uint16_t>& h, std::vector<float>& x, DType t) {
  for (size_t i = 0; i < h.size(); ++i)
    x[i] = t == DType::kBF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
}

constexpr int64_t kB = 2, kT = 70, kC = 16, kNH = 2;  // T > one 64-wide block

void add_gemm_cases(std::vector<OpCase>& ops) {
  for (int mode = 0; mode < 4; ++mode) {
    const bool ta = mode & 1, tb = mode & 2;
    const int64_t M = 7, N = 9, K = 11;
    OpCase op = make_case(std::string("gemm_") + (ta ? "t" : "n") + (tb ? "t" : "n"), {Op::kGemm},
                          {M * K, K * N, M * N}, {M * N}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      using T = std::decay_t<decltype(in[0][0])>;
      out[0] = in[2];  // beta C
      be.gemm(ta, tb, M, N, K, T(0.75), in[0].data(), ta ? M : K, in[1].data(), tb ? K : N, T(0.5),
              out[0].data(), N);
    });
    ops.push_back(op);
  }
  {
    const int64_t N = 13, C = 7, OC = 9;
    OpCase op = make_case("matmul", {Op::kMatmulForward, Op::kMatmulBackward}, {N * C, C * OC, OC},
                          {N * OC}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.matmul_forward(out[0].data(), in[0].data(), in[1].data(), in[2].data(), N, C, OC);
    });
    set_backward(op, [=](const auto& be, const auto& in, const auto&, const auto& d, auto& g) {
      be.matmul_backward(g[0].data(), g[1].data(), g[2].data(), d[0].data(), in[0].data(),
                         in[1].data(), N, C, OC);
    });
    ops.push_back(op);
  }
  {
    // A 16-bit weight multiplied as it is: the f32 backends round the
    // input to bf16 too (a bf16 GEMM), the reference multiplies the widened
    // weight exactly, so the bound is bf16's.
    const int64_t N = 13, C = 40, OC = 9;
    OpCase op =
        make_case("matmul_bf16_weight", {Op::kMatmulForward}, {N * C, C * OC}, {N * OC}, {true});
    op.fwd_tol = 3e-2;
    set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
      const std::vector<uint16_t> w16 = to_16(in[1], DType::kBF16);
      be.matmul_forward(out[0].data(), in[0].data(), Weight<float>(w16.data(), DType::kBF16),
                        nullptr, N, C, OC);
    });
    ops.push_back(op);
  }
  {
    const int64_t N = 11, C = 8, V = 10;
    OpCase op = make_case("matmul_nt", {Op::kMatmulNtForward, Op::kMatmulNtBackward},
                          {N * C, V * C}, {N * V}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.matmul_nt_forward(out[0].data(), in[0].data(), in[1].data(), N, C, V);
    });
    set_backward(op, [=](const auto& be, const auto& in, const auto&, const auto& d, auto& g) {
      be.matmul_nt_backward(g[0].data(), g[1].data(), d[0].data(), in[0].data(), in[1].data(), N, C,
                            V);
    });
    ops.push_back(op);
  }
}

void add_layer_cases(std::vector<OpCase>& ops) {
  {
    const int64_t N = 9, C = 12;
    OpCase op = make_case("layernorm", {Op::kLayerNormForward, Op::kLayerNormBackward},
                          {N * C, C, C}, {N * C, N, N}, {true, false, false});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.layernorm_forward(out[0].data(), out[1].data(), out[2].data(), in[0].data(), in[1].data(),
                           in[2].data(), N, C);
    });
    set_backward(op, [=](const auto& be, const auto& in, const auto& out, const auto& d, auto& g) {
      be.layernorm_backward(g[0].data(), g[1].data(), g[2].data(), d[0].data(), in[0].data(),
                            in[1].data(), out[1].data(), out[2].data(), N, C);
    });
    ops.push_back(op);
  }
  {
    const int64_t n = 300;
    OpCase op = make_case("gelu", {Op::kGeluForward, Op::kGeluBackward}, {n}, {n}, {true});
    op.adjust_inputs = [](Vecs<double>& in) {
      for (auto& x : in[0]) x *= 4;  // the saturated tails too
    };
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.gelu_forward(out[0].data(), in[0].data(), n);
    });
    set_backward(op, [=](const auto& be, const auto& in, const auto&, const auto& d, auto& g) {
      be.gelu_backward(g[0].data(), in[0].data(), d[0].data(), n);
    });
    ops.push_back(op);
  }
  {
    const int64_t n = 50;
    OpCase op = make_case("residual", {Op::kResidualForward, Op::kAdd}, {n, n}, {n}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.residual_forward(out[0].data(), in[0].data(), in[1].data(), n);
    });
    set_backward(op, [=](const auto& be, const auto&, const auto&, const auto& d, auto& g) {
      be.add(g[0].data(), d[0].data(), n);
      be.add(g[1].data(), d[0].data(), n);
    });
    ops.push_back(op);
  }
  {
    const int64_t N = 6, C = 5;
    OpCase op = make_case("bias_add", {Op::kBiasAdd}, {N * C, C}, {N * C}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      out[0] = in[0];
      be.bias_add(out[0].data(), in[1].data(), N, C);
    });
    ops.push_back(op);
  }
  for (float p : {0.0f, 0.25f}) {
    // Rows [row0, row0 + n) of a (B, T) grid: a sequence-parallel slice.
    static const DropoutStream streams[2] = {DropoutStream(11, 3, 0.0f),
                                             DropoutStream(11, 3, 0.25f)};
    const DropoutSpec spec{&streams[p > 0 ? 1 : 0], 4, dropout_site(2, DropoutSite::kMlpResid)};
    const int64_t Tn = 7, C = 8, row0 = 5, n = 9;
    OpCase op =
        make_case(p > 0 ? "dropout_p25" : "dropout_p0", {Op::kDropout}, {n * C}, {n * C}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      out[0] = in[0];
      be.dropout(out[0].data(), spec, Tn, C, row0, n);
    });
    set_backward(op, [=](const auto& be, const auto&, const auto&, const auto& d, auto& g) {
      auto dx = d[0];
      be.dropout(dx.data(), spec, Tn, C, row0, n);
      be.add(g[0].data(), dx.data(), n * C);
    });
    ops.push_back(op);
  }
  for (float p : {0.0f, 0.25f}) {
    static const DropoutStream streams[2] = {DropoutStream(11, 3, 0.0f),
                                             DropoutStream(11, 3, 0.25f)};
    const DropoutSpec drop{&streams[p > 0 ? 1 : 0], 5, dropout_site(1, DropoutSite::kAttnProbs)};
    OpCase op = make_case(p > 0 ? "attention_dropout" : "attention",
                          {Op::kAttentionForward, Op::kAttentionBackward}, {kB * kT * 3 * kC},
                          {kB * kT * kC, kB * kNH * kT}, {true, false});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.attention_forward(out[0].data(), out[1].data(), in[0].data(), kB, kT, kC, kNH, drop);
    });
    set_backward(op, [=](const auto& be, const auto& in, const auto& out, const auto& d, auto& g) {
      be.attention_backward(g[0].data(), d[0].data(), in[0].data(), out[0].data(), out[1].data(),
                            kB, kT, kC, kNH, drop);
    });
    ops.push_back(op);
  }
}

void add_loss_cases(std::vector<OpCase>& ops) {
  {
    const int64_t N = 10, V = 50, Vp = 64;
    const auto targets = make_tokens(N, static_cast<int32_t>(V), 3);
    OpCase op = make_case("cross_entropy", {Op::kCrossEntropyForward, Op::kCrossEntropyBackward},
                          {N * Vp}, {N, N}, {true, false});
    op.accumulates = false;  // overwrites the logits with their gradient
    op.adjust_inputs = [=](Vecs<double>& in) {
      for (int64_t n = 0; n < N; ++n)  // padding may hold anything; it must not count
        for (int64_t v = V; v < Vp; ++v) in[0][n * Vp + v] = 100.0;
    };
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.cross_entropy_forward(out[0].data(), out[1].data(), in[0].data(), targets.data(), N, V,
                               Vp);
    });
    set_backward(op, [=](const auto& be, const auto& in, const auto& out, const auto& d, auto& g) {
      g[0] = in[0];
      be.cross_entropy_backward(g[0].data(), out[1].data(), targets.data(), d[0].data(), N, V, Vp,
                                0);
    });
    ops.push_back(op);
  }
  {
    // A vocabulary-parallel rank's columns [v0, v0 + Vp), V of them real:
    // the softmax gradient against the global lse (inputs: logits, lse, dloss).
    const int64_t N = 8, V = 20, Vp = 24, v0 = 24;
    const auto targets = make_tokens(N, 60, 4);
    OpCase op = make_case("cross_entropy_backward_slice", {Op::kCrossEntropyBackward},
                          {N * Vp, N, N}, {N * Vp}, {true});
    op.adjust_inputs = [=](Vecs<double>& in) {
      for (auto& x : in[1]) x = std::abs(x) + 3;  // an lse above the slice's own
    };
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      out[0] = in[0];
      be.cross_entropy_backward(out[0].data(), in[1].data(), targets.data(), in[2].data(), N, V, Vp,
                                v0);
    });
    ops.push_back(op);
  }
  {
    const int64_t N = 8, V = 20, Vp = 24, v0 = 24;
    const auto targets = make_tokens(N, 60, 5);
    OpCase op =
        make_case("vocab_logit_stats", {Op::kVocabLogitStats}, {N * Vp}, {N, N}, {true, true});
    op.fwd_tol = 0;
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.vocab_logit_stats(out[0].data(), out[1].data(), in[0].data(), targets.data(), N, V, Vp,
                           v0);
    });
    ops.push_back(op);
  }
  {
    const int64_t N = 8, V = 20, Vp = 24;
    OpCase op = make_case("vocab_sum_exp", {Op::kVocabSumExp}, {N * Vp, N}, {N}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.vocab_sum_exp(out[0].data(), in[0].data(), in[1].data(), N, V, Vp);
    });
    ops.push_back(op);
  }
}

void add_embedding_cases(std::vector<OpCase>& ops) {
  {
    const int64_t B = 2, T = 5, C = 6, V = 9;
    const auto tokens = make_tokens(B * T, static_cast<int32_t>(V), 7);
    OpCase op = make_case("encoder", {Op::kEncoderForward, Op::kEncoderBackward}, {V * C, T * C},
                          {B * T * C}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.encoder_forward(out[0].data(), tokens.data(), in[0].data(), in[1].data(), B, T, C);
    });
    set_backward(op, [=](const auto& be, const auto&, const auto&, const auto& d, auto& g) {
      be.encoder_backward(g[0].data(), g[1].data(), d[0].data(), tokens.data(), B, T, C, 0, V);
    });
    ops.push_back(op);
  }
  {
    // The gradient of the vocabulary rows [v0, v1) alone (inputs: the
    // output gradient, the starting dwte rows and dwpe).
    const int64_t B = 2, T = 5, C = 6, v0 = 3, v1 = 7;
    const auto tokens = make_tokens(B * T, 10, 8);
    OpCase op = make_case("encoder_backward_rows", {Op::kEncoderBackward},
                          {B * T * C, (v1 - v0) * C, T * C}, {(v1 - v0) * C, T * C}, {true, true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      out[0] = in[1], out[1] = in[2];
      be.encoder_backward(out[0].data(), out[1].data(), in[0].data(), tokens.data(), B, T, C, v0,
                          v1);
    });
    ops.push_back(op);
  }
  {
    const int64_t N = 10, C = 6, v0 = 4, v1 = 9;
    const auto tokens = make_tokens(N, 12, 9);
    OpCase op =
        make_case("embedding_lookup", {Op::kEmbeddingLookup}, {(v1 - v0) * C}, {N * C}, {true});
    op.fwd_tol = 0;
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.embedding_lookup(out[0].data(), tokens.data(), in[0].data(), N, C, v0, v1);
    });
    ops.push_back(op);
  }
  {
    const int64_t Tn = 5, C = 6, row0 = 3, n = 8;
    OpCase op = make_case("add_positions", {Op::kAddPositions}, {n * C, Tn * C}, {n * C}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      out[0] = in[0];
      be.add_positions(out[0].data(), in[1].data(), Tn, C, row0, n);
    });
    ops.push_back(op);
  }
}

void add_optimizer_cases(std::vector<OpCase>& ops) {
  const AdamWParams hp{1e-2, 0.9, 0.95, 1e-8, 0.1, 3};
  auto positive_v = [](Vecs<double>& in) {
    for (auto& x : in[3]) x = std::abs(x);
  };
  {
    const int64_t n = 37;
    OpCase op = make_case("adamw", {Op::kAdamW}, {n, n, n, n}, {n, n, n}, {true, true, true});
    op.adjust_inputs = positive_v;
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      out[0] = in[0], out[1] = in[2], out[2] = in[3];
      be.adamw(out[0].data(), in[1].data(), out[1].data(), out[2].data(), n, hp);
    });
    ops.push_back(op);
  }
  for (DType t : {DType::kBF16, DType::kF16}) {
    const int64_t n = 37;
    OpCase op = make_case("adamw_16_" + std::string(dtype_name(t)), {Op::kAdamW16}, {n, n, n, n},
                          {n, n, n, n}, {true, true, true, true});
    op.adjust_inputs = positive_v;
    op.fwd_tol = 1e-5;
    set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
      out[0] = in[0], out[1] = in[2], out[2] = in[3];
      const std::vector<uint16_t> g16 = to_16(in[1], t);
      std::vector<uint16_t> p16(static_cast<size_t>(n));
      be.adamw_16(out[0].data(), g16.data(), 0.5f, out[1].data(), out[2].data(), p16.data(), n, t,
                  hp);
      from_16(p16, out[3], t);
    });
    ops.push_back(op);
  }
}

void add_precision_cases(std::vector<OpCase>& ops) {
  {
    const int64_t n = 200001;  // more than one of the fixed chunks
    OpCase op =
        make_case("sum_squares_scale", {Op::kSumSquares, Op::kScale}, {n}, {1, n}, {true, true});
    op.fwd_tol = 1e-12;
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      using T = std::decay_t<decltype(in[0][0])>;
      out[0][0] = T(be.sum_squares(in[0].data(), n));
      out[1] = in[0];
      be.scale(out[1].data(), n, T(0.5));
    });
    ops.push_back(op);
  }
  for (DType t : {DType::kBF16, DType::kF16}) {
    const std::string s(dtype_name(t));
    {
      const int64_t n = 1000;
      OpCase op = make_case("round_widen_" + s, {Op::kRound16, Op::kWiden16}, {n}, {n}, {true});
      op.fwd_tol = 0;  // rounding to nearest even has one answer
      op.adjust_inputs = [](Vecs<double>& in) {
        for (size_t i = 0; i < in[0].size(); i += 7) in[0][i] *= 1e4;  // f16's large values too
      };
      set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
        std::vector<uint16_t> h(static_cast<size_t>(n));
        be.round_16(in[0].data(), h.data(), n, t);
        be.widen_16(h.data(), out[0].data(), n, t);
      });
      ops.push_back(op);
    }
    {
      const int64_t n = 200001;
      OpCase op = make_case("sum_squares_scale_" + s, {Op::kSumSquares16, Op::kScale16}, {n},
                            {1, n}, {true, true});
      op.fwd_tol = 1e-12;
      set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
        std::vector<uint16_t> h = to_16(in[0], t);
        out[0][0] = static_cast<float>(be.sum_squares_16(h.data(), n, t));
        be.scale_16(h.data(), n, 0.375f, t);
        from_16(h, out[1], t);
      });
      ops.push_back(op);
    }
    for (bool addend16 : {false, true}) {
      const int64_t n = 300;
      OpCase op = make_case("accumulate_" + s + (addend16 ? "_16bit_addend" : "_f32_addend"),
                            {Op::kAccumulate16}, {n, n}, {n}, {true});
      op.fwd_tol = 0;
      set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
        std::vector<uint16_t> acc = to_16(in[0], t), x16 = to_16(in[1], t);
        be.accumulate_16(addend16 ? nullptr : in[1].data(), addend16 ? x16.data() : nullptr, 0.25f,
                         acc.data(), n, t);
        from_16(acc, out[0], t);
      });
      ops.push_back(op);
    }
    {
      // Per row of 10: whether it holds an infinity or NaN (rows 2 and 5 do).
      const int64_t rows = 8, n = 10;
      OpCase op = make_case("nonfinite_" + s, {Op::kNonfinite16}, {rows * n}, {rows}, {true});
      op.fwd_tol = 0;
      op.adjust_inputs = [](Vecs<double>& in) {
        in[0][2 * 10 + 3] = INFINITY;
        in[0][5 * 10 + 9] = NAN;
      };
      set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
        const std::vector<uint16_t> h = to_16(in[0], t);
        for (int64_t r = 0; r < rows; ++r)
          out[0][static_cast<size_t>(r)] = be.nonfinite_16(h.data() + r * n, n, t) ? 1.0f : 0.0f;
      });
      ops.push_back(op);
    }
  }
}

void add_memory_cases(std::vector<OpCase>& ops) {
  const int64_t n = 70000;  // above the size that copy and fill split across threads
  OpCase op = make_case("copy_fill_axpy", {Op::kCopy, Op::kFill, Op::kAxpy}, {n, n}, {n, n, n},
                        {true, true, true});
  op.fwd_tol = 1e-6;  // f32 axpy near cancellation
  set_forward(op, [=](const auto& be, const auto& in, auto& out) {
    using T = std::decay_t<decltype(in[0][0])>;
    be.copy(out[0].data(), in[0].data(), n);
    be.fill(out[1].data(), n, T(-2.5));
    out[2] = in[0];
    be.axpy(out[2].data(), T(-0.75), in[1].data(), n);
  });
  ops.push_back(op);
}

std::vector<OpCase> make_ops() {
  std::vector<OpCase> ops;
  add_gemm_cases(ops);
  add_layer_cases(ops);
  add_loss_cases(ops);
  add_embedding_cases(ops);
  add_optimizer_cases(ops);
  add_precision_cases(ops);
  add_memory_cases(ops);
  return ops;
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
// gradients computed from zero.
TEST_P(BackendGrads, BackwardAddsIntoGradientsThatAreNotZero) {
  const BackendCase& b = backend_case();
  const OpCase& op = op_case();
  if (!op.accumulates) GTEST_SKIP() << op.name << " overwrites its input's gradient by contract";
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
      ASSERT_NEAR(added[k][i], start[k][i] + from_zero[k][i], 1e-12 * (1 + std::abs(added[k][i])))
          << op.name << " on " << b.name << ": input " << k << " element " << i;
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
                 Op::kScale16, Op::kNonfinite16})
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

}  // namespace
}  // namespace loom
