// The entries of the backend operation table: each operation of
// kernels/backend.h with its shapes, its forward and (where it has one) its
// backward, as every backend runs them.
#include "backend_op_cases.h"

namespace loom::backend_test {

namespace {

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
  // The input's gradient added, and written over (GradWrite::kSet) while
  // the weight's and the bias's are still added.
  for (const GradWrite w : {GradWrite::kAdd, GradWrite::kSet}) {
    const int64_t N = 13, C = 7, OC = 9;
    OpCase op =
        make_case(w == GradWrite::kAdd ? "matmul" : "matmul_set_dinp",
                  {Op::kMatmulForward, Op::kMatmulBackward}, {N * C, C * OC, OC}, {N * OC}, {true});
    if (w == GradWrite::kSet) op.sets = {true, false, false};
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.matmul_forward(out[0].data(), in[0].data(), in[1].data(), in[2].data(), N, C, OC);
    });
    set_backward(op, [=](const auto& be, const auto& in, const auto&, const auto& d, auto& g) {
      be.matmul_backward(g[0].data(), g[1].data(), g[2].data(), d[0].data(), in[0].data(),
                         in[1].data(), N, C, OC, w);
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
  // C 12: the rows' ragged ends alone; C 37: two blocks of the CPU's 16
  // lanes and a ragged end.
  for (const int64_t C : {12, 37}) {
    const int64_t N = 9;
    OpCase op = make_case(C == 12 ? "layernorm" : "layernorm_c37",
                          {Op::kLayerNormForward, Op::kLayerNormBackward}, {N * C, C, C},
                          {N * C, N, N}, {true, false, false});
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
    op.sets = {true};  // the layer's scratch, written over
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
  for (DType t : {DType::kBF16, DType::kF16}) {
    // GELU written straight into 16 bits: the f32 values rounded, so within
    // one 16-bit rounding of the reference's (bit for bit gelu_forward
    // rounded: test_precision.cc).
    const int64_t n = 3000;
    OpCase op = make_case("gelu_forward_16_" + std::string(dtype_name(t)), {Op::kGeluForward16},
                          {n}, {n}, {true});
    op.fwd_tol = t == DType::kBF16 ? 8e-3 : 1e-3;
    op.adjust_inputs = [](Vecs<double>& in) {
      for (auto& x : in[0]) x *= 4;
    };
    set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
      std::vector<uint16_t> h(static_cast<size_t>(n));
      be.gelu_forward_16(h.data(), in[0].data(), n, t);
      from_16(h, out[0], t);
    });
    ops.push_back(op);
  }
  for (DType t : {DType::kBF16, DType::kF16}) {
    // GELU that records its input in 16 bits: forward gives the f32 output
    // (or, with out16, the rounded one) and the input rounded, both within
    // one 16-bit rounding of the reference's; backward reads the input's
    // 16-bit values (the case's input rounded), so the reference's backward
    // of the same values is f32's bound away (bit for bit the f32 forms':
    // test_precision.cc).
    const int64_t n = 3000;
    for (bool rounded_out : {false, true}) {
      OpCase op = make_case(std::string("gelu_forward_record_16_") + (rounded_out ? "out16_" : "") +
                                std::string(dtype_name(t)),
                            {Op::kGeluForwardRecord16}, {n}, {n, n}, {true, true});
      // The rounded input is the reference's exactly; an f32 output is
      // f32's bound away.
      op.fwd_tol = !rounded_out ? 1e-5 : t == DType::kBF16 ? 8e-3 : 1e-3;
      op.adjust_inputs = [](Vecs<double>& in) {
        for (auto& x : in[0]) x *= 4;
      };
      set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
        std::vector<uint16_t> h(static_cast<size_t>(n)), x16(static_cast<size_t>(n));
        be.gelu_forward_record_16(rounded_out ? nullptr : out[0].data(),
                                  rounded_out ? h.data() : nullptr, in[0].data(), x16.data(), n, t);
        if (rounded_out) from_16(h, out[0], t);
        from_16(x16, out[1], t);
      });
      ops.push_back(op);
    }
    OpCase bwd = make_case("gelu_backward_16_" + std::string(dtype_name(t)), {Op::kGeluBackward16},
                           {n, n}, {n}, {true});
    bwd.fwd_tol = 1e-4;
    bwd.adjust_inputs = [](Vecs<double>& in) {
      for (auto& x : in[0]) x *= 4;
    };
    set_forward_f32(bwd, [=](const auto& be, const auto& in, auto& out) {
      be.gelu_backward_16(out[0].data(), to_16(in[0], t).data(), in[1].data(), n, t);
    });
    ops.push_back(bwd);
  }
  for (DType t : {DType::kBF16, DType::kF16}) {
    // A LayerNorm written straight into 16 bits: within one 16-bit rounding
    // of the reference's output, its statistics in f32 (bit for bit
    // layernorm_forward rounded: test_precision.cc).
    const int64_t N = 7, C = 37;
    OpCase op =
        make_case("layernorm_forward_16_" + std::string(dtype_name(t)), {Op::kLayerNormForward16},
                  {N * C, C, C}, {N * C, N, N}, {true, true, true});
    op.fwd_tol = t == DType::kBF16 ? 8e-3 : 1e-3;
    set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
      std::vector<uint16_t> h(static_cast<size_t>(N * C));
      be.layernorm_forward_16(h.data(), out[1].data(), out[2].data(), in[0].data(), in[1].data(),
                              in[2].data(), N, C, t);
      from_16(h, out[0], t);
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
    // Dropout and the residual add in one pass, out of place and in place;
    // its backward: the gradient dropped (out of place, no residual) into
    // x's, and passed as it is to the residual's.
    static const DropoutStream streams[2] = {DropoutStream(11, 3, 0.0f),
                                             DropoutStream(11, 3, 0.25f)};
    const DropoutSpec spec{&streams[p > 0 ? 1 : 0], 4, dropout_site(2, DropoutSite::kAttnResid)};
    const int64_t Tn = 7, C = 8, row0 = 5, n = 9;
    for (const bool in_place : {false, true}) {
      OpCase op = make_case(std::string(p > 0 ? "dropout_residual_p25" : "dropout_residual_p0") +
                                (in_place ? "_in_place" : ""),
                            {Op::kDropoutResidual}, {n * C, n * C}, {n * C}, {true});
      set_forward(op, [=](const auto& be, const auto& in, auto& out) {
        if (in_place) {
          out[0] = in[0];
          be.dropout_residual(out[0].data(), out[0].data(), in[1].data(), spec, Tn, C, row0, n);
        } else {
          be.dropout_residual(out[0].data(), in[0].data(), in[1].data(), spec, Tn, C, row0, n);
        }
      });
      set_backward(op, [=](const auto& be, const auto&, const auto&, const auto& d, auto& g) {
        auto dx = d[0];
        be.dropout_residual(dx.data(), d[0].data(), nullptr, spec, Tn, C, row0, n);
        be.add(g[0].data(), dx.data(), n * C);
        be.add(g[1].data(), d[0].data(), n * C);
      });
      ops.push_back(op);
    }
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
    op.sets = {true};  // q|k|v's gradient written over the buffer
    ops.push_back(op);
  }
  {
    // The 16-bit forms. Forward: attention_forward's outputs, and q|k|v
    // rounded to bf16 (compared widened; the reference rounds the same f32
    // values, so those match exactly and the outputs to f32's bound).
    // Backward: from q|k|v's bf16 values, given the forward of those values
    // widened; the reference backward of the same values is f32's bound
    // away.
    static const DropoutStream stream(11, 3, 0.25f);
    const DropoutSpec drop{&stream, 5, dropout_site(1, DropoutSite::kAttnProbs)};
    const int64_t nqkv = kB * kT * 3 * kC;
    OpCase fwd = make_case("attention_forward_16", {Op::kAttentionForward16}, {nqkv},
                           {kB * kT * kC, kB * kNH * kT, nqkv}, {true, true, true});
    set_forward_f32(fwd, [=](const auto& be, const auto& in, auto& out) {
      std::vector<uint16_t> h(static_cast<size_t>(nqkv));
      be.attention_forward_16(out[0].data(), out[1].data(), in[0].data(), h.data(), kB, kT, kC, kNH,
                              drop);
      from_16(h, out[2], DType::kBF16);
    });
    ops.push_back(fwd);
    OpCase bwd = make_case("attention_backward_16", {Op::kAttentionBackward16},
                           {nqkv, kB * kT * kC}, {nqkv}, {true});
    bwd.fwd_tol = 1e-4;
    set_forward_f32(bwd, [=](const auto& be, const auto& in, auto& out) {
      const std::vector<uint16_t> h = to_16(in[0], DType::kBF16);
      std::vector<float> widened(static_cast<size_t>(nqkv)), y(static_cast<size_t>(kB * kT * kC)),
          lse(static_cast<size_t>(kB * kNH * kT));
      from_16(h, widened, DType::kBF16);
      be.attention_forward(y.data(), lse.data(), widened.data(), kB, kT, kC, kNH, drop);
      be.attention_backward_16(out[0].data(), in[1].data(), h.data(), y.data(), lse.data(), kB, kT,
                               kC, kNH, drop);
    });
    ops.push_back(bwd);
  }
}

void add_chunk_attention_cases(std::vector<OpCase>& ops) {
  for (float p : {0.0f, 0.25f}) {
    static const DropoutStream streams[2] = {DropoutStream(13, 2, 0.0f),
                                             DropoutStream(13, 2, 0.25f)};
    const DropoutSpec drop{&streams[p > 0 ? 1 : 0], 3, dropout_site(0, DropoutSite::kAttnProbs)};
    const int64_t B = 2, Tn = 12, C = 8, NH = 2, Tc = 3;
    OpCase op = make_case(p > 0 ? "attention_chunks_dropout" : "attention_chunks",
                          {Op::kAttentionChunkForward, Op::kAttentionChunkBackward},
                          {B * Tn * 3 * C}, {B * Tn * C, B * NH * Tn}, {true, false});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      chunked_attention(be, out[0].data(), out[1].data(), in[0].data(), B, Tn, C, NH, Tc, drop);
    });
    set_backward(op, [=](const auto& be, const auto& in, const auto& out, const auto& d, auto& g) {
      chunked_attention_backward(be, g[0].data(), d[0].data(), in[0].data(), out[0].data(),
                                 out[1].data(), B, Tn, C, NH, Tc, drop);
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
    op.sets = {true};  // overwrites the logits with their gradient
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
  for (DType t : {DType::kBF16, DType::kF16}) {
    // The gradient written straight into 16 bits: within one 16-bit
    // rounding of the reference's (bit for bit cross_entropy_backward
    // rounded: test_precision.cc), padding zero, a slice's range (inputs:
    // logits, lse, dloss).
    const int64_t N = 8, V = 20, Vp = 24, v0 = 24;
    const auto targets = make_tokens(N, 60, 6);
    OpCase op = make_case("cross_entropy_backward_16_" + std::string(dtype_name(t)),
                          {Op::kCrossEntropyBackward16}, {N * Vp, N, N}, {N * Vp}, {true});
    op.fwd_tol = t == DType::kBF16 ? 8e-3 : 1e-3;
    op.adjust_inputs = [=](Vecs<double>& in) {
      for (auto& x : in[1]) x = std::abs(x) + 3;
    };
    set_forward_f32(op, [=](const auto& be, const auto& in, auto& out) {
      std::vector<uint16_t> h(static_cast<size_t>(N * Vp), 0xffff);
      be.cross_entropy_backward_16(h.data(), in[0].data(), in[1].data(), targets.data(),
                                   in[2].data(), N, V, Vp, v0, t);
      from_16(h, out[0], t);
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
      be.encoder_forward(out[0].data(), tokens.data(), in[0].data(), in[1].data(), B, T, C,
                         nullptr);
    });
    set_backward(op, [=](const auto& be, const auto&, const auto&, const auto& d, auto& g) {
      be.encoder_backward(g[0].data(), g[1].data(), d[0].data(), tokens.data(), B, T, C, 0, V,
                          nullptr);
    });
    ops.push_back(op);
  }
  {
    // Context parallelism: local positions mapped to global ones of a longer sequence.
    const int64_t B = 2, T = 4, C = 6, V = 9, maxT = 8;
    const auto tokens = make_tokens(B * T, static_cast<int32_t>(V), 11);
    const std::vector<int32_t> pos = {1, 2, 5, 6};
    OpCase op = make_case("encoder_positions", {Op::kEncoderForward, Op::kEncoderBackward},
                          {V * C, maxT * C}, {B * T * C}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      be.encoder_forward(out[0].data(), tokens.data(), in[0].data(), in[1].data(), B, T, C,
                         pos.data());
    });
    set_backward(op, [=](const auto& be, const auto&, const auto&, const auto& d, auto& g) {
      be.encoder_backward(g[0].data(), g[1].data(), d[0].data(), tokens.data(), B, T, C, 0, V,
                          pos.data());
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
                          v1, nullptr);
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
      be.add_positions(out[0].data(), in[1].data(), Tn, C, row0, n, nullptr);
    });
    ops.push_back(op);
  }
  {
    const int64_t Tn = 4, C = 6, row0 = 1, n = 6, maxT = 8;
    const std::vector<int32_t> pos = {0, 3, 4, 7};
    OpCase op =
        make_case("add_positions_mapped", {Op::kAddPositions}, {n * C, maxT * C}, {n * C}, {true});
    set_forward(op, [=](const auto& be, const auto& in, auto& out) {
      out[0] = in[0];
      be.add_positions(out[0].data(), in[1].data(), Tn, C, row0, n, pos.data());
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

}  // namespace

std::vector<OpCase> make_ops() {
  std::vector<OpCase> ops;
  add_gemm_cases(ops);
  add_layer_cases(ops);
  add_loss_cases(ops);
  add_chunk_attention_cases(ops);
  add_embedding_cases(ops);
  add_optimizer_cases(ops);
  add_precision_cases(ops);
  add_memory_cases(ops);
  return ops;
}

}  // namespace loom::backend_test
