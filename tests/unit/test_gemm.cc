// The GEMM backends: each against a naive double reference for every
// transpose combination, leading dimensions and alpha/beta; kernels.gemm's
// choice and its errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/io/fs.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/cpu/gemm_census.h"
#include "loom/kernels/cpu/matmul.h"
#include "loom/profile/gemm_peak.h"
#include "loom/train/config.h"
#include "loom/train/gemm_choice.h"
#include "test_util.h"

namespace loom {
namespace {

using test::error_of;
constexpr cpu::GemmBackend kBlas = cpu::GemmBackend::kOpenBlas;

std::vector<cpu::GemmBackend> available() {
  std::vector<cpu::GemmBackend> out;
  for (auto b : {cpu::GemmBackend::kOpenBlas, cpu::GemmBackend::kOneDnn})
    if (cpu::gemm_backend_available(b)) out.push_back(b);
  return out;
}

// GradWrite::kSet never reads the input gradient it writes (beta 0): from a
// buffer of NaNs the same bits as kAdd from zeros, on every GEMM backend,
// with f32 inputs and, where they run, bf16 and fp16 ones (oneDNN's matmul,
// the fp16 K-tiles: K spans several tiles), with and without the weight's
// gradient beside it; a product over OC = 0 writes zeros.
TEST(Gemm, SetInputGradientNeverReadsIt) {
  const int64_t N = 19, C = 23, OC = 600;
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-1, 1);
  auto rnd = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = u(gen);
    return v;
  };
  const std::vector<float> inp = rnd(N * C), w = rnd(C * OC), dout = rnd(N * OC);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (cpu::GemmBackend b : available())
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      if (t == DType::kBF16 && !cpu::gemm_16_uses_bf16_matmul(t)) continue;
      const cpu::GemmConfig g{b, t};
      for (const bool with_dw : {false, true}) {
        std::vector<float> want(static_cast<size_t>(N * C), 0.0f), got(want.size(), nan);
        std::vector<float> dw1(static_cast<size_t>(C * OC), 0.0f), dw2 = dw1;
        cpu::matmul_backward<float>(g, want.data(), with_dw ? dw1.data() : nullptr, nullptr,
                                    dout.data(), inp.data(), w.data(), N, C, OC, GradWrite::kAdd);
        cpu::matmul_backward<float>(g, got.data(), with_dw ? dw2.data() : nullptr, nullptr,
                                    dout.data(), inp.data(), w.data(), N, C, OC, GradWrite::kSet);
        EXPECT_EQ(got, want) << cpu::gemm_backend_name(b) << " " << dtype_name(t) << " dW "
                             << with_dw;
        EXPECT_EQ(dw2, dw1) << cpu::gemm_backend_name(b) << " " << dtype_name(t);
      }
      std::vector<float> empty(static_cast<size_t>(N * C), nan);
      cpu::matmul_backward<float>(g, empty.data(), nullptr, nullptr, dout.data(), inp.data(),
                                  w.data(), N, C, 0, GradWrite::kSet);
      EXPECT_EQ(empty, std::vector<float>(empty.size(), 0.0f)) << "OC 0";
    }
}

// Two shapes, so that on oneDNN both f32 routes run: 97 x 70 x 131 puts NT
// and TN on its matmul primitive (f32_matmul_form), 70 x 131 x 97 keeps them
// on its sgemm.
TEST(Gemm, EveryBackendMatchesANaiveReference) {
  for (const auto& [M, N, K] :
       {std::tuple<int64_t, int64_t, int64_t>{97, 70, 131}, {70, 131, 97}}) {
    const int64_t pad = 3;
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> u(-1, 1);
    for (cpu::GemmBackend b : available()) {
      const cpu::GemmConfig g{b};
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          // Row-major with leading dimensions larger than the rows need.
          const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
          std::vector<float> A((ta ? K : M) * lda), B((tb ? N : K) * ldb), C(M * ldc);
          for (auto* v : {&A, &B, &C})
            for (float& x : *v) x = u(gen);
          std::vector<float> C0 = C;
          const float alpha = 0.75f, beta = -0.5f;
          cpu::gemm<float>(g, ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(),
                           ldc);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) {
              double s = 0;
              for (int64_t k = 0; k < K; ++k)
                s += double(ta ? A[k * lda + i] : A[i * lda + k]) *
                     double(tb ? B[j * ldb + k] : B[k * ldb + j]);
              const double want = alpha * s + beta * double(C0[i * ldc + j]);
              ASSERT_NEAR(C[i * ldc + j], want, 1e-4 * (1 + std::abs(want)))
                  << cpu::gemm_backend_name(b) << " ta " << ta << " tb " << tb << " at " << i << ","
                  << j;
            }
          // The padding between rows is left alone.
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = N; j < ldc; ++j) ASSERT_EQ(C[i * ldc + j], C0[i * ldc + j]);
        }
    }
  }
}

// Which f32 forms run on oneDNN's matmul primitive: a transposed B with
// K >= N and a transposed A with M > N, at gpt-m's shapes (BT 2048, C 512)
// the input gradients of c_attn, attn.c_proj and mlp.c_fc and the weight
// gradients of mlp.c_proj and the LM head; never NN or TT, nor under 64 in
// any dimension. The same numbers (to f32 rounding) from inside a parallel
// region, of two threads or of one, where the sgemm runs.
TEST(Gemm, F32FormsOnTheMatmulPrimitiveFollowTheRule) {
  const bool onednn = cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn);
  EXPECT_EQ(cpu::f32_matmul_form(false, true, 2048, 512, 1536), onednn);  // c_attn dx
  EXPECT_EQ(cpu::f32_matmul_form(false, true, 2048, 512, 512), onednn);   // attn.c_proj dx
  EXPECT_EQ(cpu::f32_matmul_form(false, true, 2048, 512, 2048), onednn);  // mlp.c_fc dx
  EXPECT_FALSE(cpu::f32_matmul_form(false, true, 2048, 2048, 512));       // mlp.c_proj dx
  EXPECT_FALSE(cpu::f32_matmul_form(false, true, 2048, 8192, 512));       // LM head forward
  EXPECT_EQ(cpu::f32_matmul_form(true, false, 2048, 512, 2048), onednn);  // mlp.c_proj dw
  EXPECT_EQ(cpu::f32_matmul_form(true, false, 8192, 512, 2048), onednn);  // LM head dw
  EXPECT_FALSE(cpu::f32_matmul_form(true, false, 512, 2048, 2048));       // mlp.c_fc dw
  EXPECT_FALSE(cpu::f32_matmul_form(true, false, 512, 512, 2048));        // attn.c_proj dw
  EXPECT_FALSE(cpu::f32_matmul_form(false, false, 2048, 512, 2048));
  EXPECT_FALSE(cpu::f32_matmul_form(true, true, 2048, 512, 2048));
  EXPECT_FALSE(cpu::f32_matmul_form(false, true, 64, 64, 0));      // a product over nothing
  EXPECT_FALSE(cpu::f32_matmul_form(true, false, 2048, 4, 2048));  // a rank-4 PowerSGD factor
  EXPECT_FALSE(cpu::f32_matmul_form(true, false, 256, 63, 64));    // under 64
  if (!onednn) return;
  const int64_t M = 160, N = 96, K = 128;
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> A(K * M), B(N * K), C0(M * N);
  for (auto* v : {&A, &B, &C0})
    for (float& x : *v) x = u(gen);
  for (const auto& [ta, tb] : {std::pair{true, false}, std::pair{false, true}}) {
    const int64_t lda = ta ? M : K, ldb = tb ? K : N;
    std::vector<float> outside = C0;
    cpu::gemm_f32(cpu::GemmBackend::kOneDnn, ta, tb, M, N, K, 1.0f, A.data(), lda, B.data(), ldb,
                  1.0f, outside.data(), N);
    for (const int threads : {2, 1}) {
      std::vector<float> inside = C0;
#pragma omp parallel num_threads(threads)
#pragma omp single
      cpu::gemm_f32(cpu::GemmBackend::kOneDnn, ta, tb, M, N, K, 1.0f, A.data(), lda, B.data(), ldb,
                    1.0f, inside.data(), N);
      for (size_t i = 0; i < outside.size(); ++i)
        ASSERT_NEAR(inside[i], outside[i], 1e-5f * (1 + std::abs(outside[i])))
            << ta << tb << " threads " << threads << " at " << i;
    }
  }
}

// A census counts each GEMM call once by its form: a linear layer's forward
// and backward (its bias rows copied first, then the product accumulating
// into them), a 16-bit product that tiles into f32 GEMMs counted as the
// one call it is, and calls from a parallel region by their team. Nothing
// is counted while closed; a replay times a form alone.
TEST(GemmCensus, CountsEachCallOnceByItsForm) {
  const int64_t N = 24, C = 16, OC = 40;
  std::vector<float> inp(N * C, 0.5f), w(C * OC, 0.25f), b(OC, 1.0f), out(N * OC),
      dout(N * OC, 0.1f), dinp(N * C), dw(C * OC), db(OC);
  const cpu::GemmConfig g{kBlas};
  cpu::matmul_forward<float>(g, out.data(), InputArg<float>{inp.data()}, WeightArg<float>{w.data()},
                             b.data(), N, C, OC);  // closed: not counted
  cpu::gemm_census_open();
  EXPECT_HAS(error_of([] { cpu::gemm_census_open(); }), "a census is already open");
  cpu::matmul_forward<float>(g, out.data(), InputArg<float>{inp.data()}, WeightArg<float>{w.data()},
                             b.data(), N, C, OC);
  cpu::matmul_backward<float>(g, dinp.data(), dw.data(), db.data(), dout.data(),
                              InputArg<float>{inp.data()}, WeightArg<float>{w.data()}, N, C, OC,
                              GradWrite::kSet);
  cpu::gemm_16(kBlas, DType::kF16, false, false, N, OC, 600, 1.0f,
               std::vector<float>(N * 600).data(), 600, std::vector<float>(600 * OC).data(), OC,
               0.0f, out.data(), OC);
  int team = 1;
#pragma omp parallel num_threads(2)
  {
#pragma omp single
    team = omp_get_num_threads();
    cpu::gemm_f32(kBlas, false, true, 8, 8, 8, 1.0f, inp.data(), 8, w.data(), 8, 0.0f,
                  std::vector<float>(64).data(), 8);
  }
  const std::vector<cpu::GemmTally> t = cpu::gemm_census_close();
  EXPECT_TRUE(cpu::gemm_census_close().empty());
  std::map<std::string, int64_t> got;
  for (const cpu::GemmTally& x : t) got[x.form.describe()] += x.calls;
  const std::map<std::string, int64_t> want = {
      {"f32 NN 24 x 40 x 16 +=C", 1},  // forward, onto the bias rows
      {"f32 NT 24 x 16 x 40", 1},      // dinp, written
      {"f32 TN 16 x 40 x 24 +=C", 1},  // dweight, accumulated
      {"f16 NN 24 x 40 x 600", 1},     // three K-tiles inside, not counted
      {team > 1 ? "f32 NT 8 x 8 x 8 (x2 threads)" : "f32 NT 8 x 8 x 8 (in a region)",
       team}};  // one a thread
  EXPECT_EQ(got, want);
  for (const cpu::GemmTally& x : t) {
    const double s = cpu::gemm_replay_seconds(x.form);
    EXPECT_GT(s, 0.0) << x.form.describe();
    EXPECT_LT(s, 1.0) << x.form.describe();
  }
  EXPECT_DOUBLE_EQ(t.front().form.flops(),
                   2.0 * t.front().form.M * t.front().form.N * t.front().form.K);
}

TEST(Gemm, KernelsGemmChoosesAndNamesTheBackend) {
  GemmChoice c = configure_gemm("openblas");
  EXPECT_EQ(c.backend, cpu::GemmBackend::kOpenBlas);
  EXPECT_HAS(c.describe, "openblas (");
  c = configure_gemm("auto");
  if (cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn)) {
    EXPECT_EQ(c.backend, cpu::GemmBackend::kOneDnn);
    EXPECT_HAS(c.describe, "auto: oneDNN whenever this build has it");
    EXPECT_EQ(configure_gemm("onednn").backend, cpu::GemmBackend::kOneDnn);
  } else {
    EXPECT_EQ(c.backend, cpu::GemmBackend::kOpenBlas);
    EXPECT_HAS(error_of([] { configure_gemm("onednn"); }),
               "kernels.gemm: onednn is not available in this build");
  }
  EXPECT_HAS(error_of([] { configure_gemm("mkl"); }),
             "kernels.gemm: unknown value \"mkl\" (expected one of auto, onednn, openblas)");
  EXPECT_HAS(error_of([] {
               parse_config(R"({"train_batch_size": 4, "data": {"synthetic": true}})", "f.json",
                            {"kernels.gemm=mkl"});
             }),
             "kernels.gemm: unknown value \"mkl\" (expected one of auto, onednn, openblas)");
}

TEST(Gemm, Bf16MatmulAccumulatesInF32) {
  if (!cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn)) GTEST_SKIP() << "no oneDNN";
  const int64_t M = 33, N = 40, K = 300;
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> A(M * K), B(K * N), C(M * N);
  for (float& x : A) x = u(gen);
  for (float& x : B) x = u(gen);
  try {
    cpu::matmul_bf16(A.data(), B.data(), C.data(), M, N, K);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kUnsupported) GTEST_SKIP() << e.what();
    throw;
  }
  // Against the product of the bf16-rounded inputs in double: only the f32
  // accumulation's rounding remains (a bf16 accumulator would be ~100x off).
  auto bf16 = [](float x) {
    uint32_t v;
    std::memcpy(&v, &x, 4);
    v += 0x7fff + ((v >> 16) & 1);
    v &= 0xffff0000u;
    float y;
    std::memcpy(&y, &v, 4);
    return double(y);
  };
  double worst = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += bf16(A[i * K + k]) * bf16(B[k * N + j]);
      worst = std::max(worst, std::abs(C[i * N + j] - s));
    }
  EXPECT_LT(worst, 1e-4);
  EXPECT_GT(cpu::measure_matmul_gflops(64, 64, 64, true, 2), 0);
  // NaN stays NaN and infinities stay infinite through the bf16 rounding.
  std::vector<float> a2 = {std::nanf(""), INFINITY, -INFINITY, 1.0f}, b2 = {1, 1, 1, 1}, c2(4);
  cpu::matmul_bf16(a2.data(), b2.data(), c2.data(), 4, 1, 1);
  EXPECT_TRUE(std::isnan(c2[0]));
  EXPECT_EQ(c2[1], INFINITY);
  EXPECT_EQ(c2[2], -INFINITY);
  EXPECT_EQ(c2[3], 1.0f);
}

TEST(Gemm, ThePeakIsTheBestBackendMeasuredOnceAndCachedPerMachine) {
  test::TempDir tmp;
  setenv("XDG_CACHE_HOME", tmp.path.c_str(), 1);
  const PeakGflops first = machine_peak_gflops(2);
  EXPECT_FALSE(first.cached);
  EXPECT_GT(first.gflops, 0);
  EXPECT_EQ(first.cache_file, (tmp.path / "loom" / "peak_gflops.json").string());
  const PeakGflops again = machine_peak_gflops(2);
  EXPECT_TRUE(again.cached);
  EXPECT_EQ(again.gflops, first.gflops);
  EXPECT_EQ(again.backend, first.backend);
  // Another thread count is another key.
  EXPECT_HAS(read_file(first.cache_file), "| 2 threads |");
  // The bf16 matmul's peak is its own, under its own key, where it runs;
  // elsewhere asking for it names why not.
  if (cpu::gemm_16_uses_bf16_matmul(DType::kBF16)) {
    EXPECT_EQ(gemm_path_for(DType::kBF16), GemmPath::kBf16Matmul);
    const PeakGflops bf16 = machine_peak_gflops(2, GemmPath::kBf16Matmul);
    EXPECT_FALSE(bf16.cached);
    EXPECT_GT(bf16.gflops, 0);
    EXPECT_EQ(bf16.backend, "onednn");
    EXPECT_HAS(read_file(first.cache_file), "| bf16 matmul");
    EXPECT_TRUE(machine_peak_gflops(2, GemmPath::kBf16Matmul).cached);
    EXPECT_EQ(machine_peak_gflops(2).gflops, first.gflops) << "the f32 entry stays";
  } else {
    EXPECT_EQ(gemm_path_for(DType::kBF16), GemmPath::kF32Sgemm);
    EXPECT_HAS(test::error_of([] { machine_peak_gflops(2, GemmPath::kBf16Matmul); }),
               "bf16 matmul");
  }
  // f32 and fp16 inputs run on the sgemm: its peak.
  EXPECT_EQ(gemm_path_for(DType::kF32), GemmPath::kF32Sgemm);
  EXPECT_EQ(gemm_path_for(DType::kF16), GemmPath::kF32Sgemm);
  unsetenv("XDG_CACHE_HOME");
}

// A cached peak below what the machine shows (measured while it was busy)
// is raised by the next remeasurement; one above it stands.
TEST(Gemm, ARemeasuredPeakKeepsTheHigherFigure) {
  test::TempDir tmp;
  setenv("XDG_CACHE_HOME", tmp.path.c_str(), 1);
  const PeakGflops first = machine_peak_gflops(2);
  const std::string file = first.cache_file;
  auto cached_as = [&](double g) {
    nlohmann::json cache = nlohmann::json::parse(read_file(file));
    ASSERT_EQ(cache.size(), 1u) << cache.dump();
    for (auto& e : cache) e["gflops"] = g;
    write_file_atomic(file, cache.dump(2));
    ASSERT_EQ(machine_peak_gflops(2).gflops, g) << "the cache is read as written";
  };
  // Stale and low: raised, and written back.
  cached_as(1.0);
  const PeakGflops raised = machine_peak_gflops(2, GemmPath::kF32Sgemm, true);
  EXPECT_FALSE(raised.cached);
  EXPECT_EQ(raised.was, 1.0);
  EXPECT_GT(raised.measured, 1.0);
  EXPECT_EQ(raised.gflops, raised.measured);
  EXPECT_EQ(machine_peak_gflops(2).gflops, raised.measured);
  // Above anything the machine reaches: it stands, and the measurement is told.
  cached_as(1e9);
  const PeakGflops kept = machine_peak_gflops(2, GemmPath::kF32Sgemm, true);
  EXPECT_TRUE(kept.cached);
  EXPECT_EQ(kept.was, 1e9);
  EXPECT_EQ(kept.gflops, 1e9);
  EXPECT_GT(kept.measured, 0);
  EXPECT_LT(kept.measured, 1e9);
  EXPECT_EQ(machine_peak_gflops(2).gflops, 1e9);
  unsetenv("XDG_CACHE_HOME");
}

// 16-bit GEMM inputs (kernels.gemm_inputs: 16bit): every transpose, leading
// dimensions wider than the matrices, alpha and beta, K across several
// tiles, against the rounded inputs' products in double. bf16 through
// oneDNN's matmul (the tiled path where this build or CPU has none), fp16
// through the tiled path; gemm<float> takes the path when its GemmConfig
// says so.
TEST(Gemm, SixteenBitInputsAccumulateInF32) {
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-1, 1);
  struct Case {
    int64_t M, N, K;
    float alpha, beta;
  };
  // K 600: three tiles of the tiled path; then a layer's shapes (forward,
  // weight gradient accumulating, a scaled attention product).
  for (const Case& c : {Case{19, 23, 600, 0.75f, 0.5f}, Case{128, 96, 32, 1.0f, 0.0f},
                        Case{32, 96, 128, 1.0f, 1.0f}, Case{16, 16, 8, 0.125f, 0.0f}})
    for (DType t : {DType::kBF16, DType::kF16})
      for (bool ta : {false, true})
        for (bool tb : {false, true}) {
          const int64_t M = c.M, N = c.N, K = c.K;
          const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 5;
          std::vector<float> A((ta ? K : M) * lda), B((tb ? N : K) * ldb), C(M * ldc), C0;
          for (float& x : A) x = u(gen);
          for (float& x : B) x = u(gen);
          for (float& x : C) x = u(gen);
          C0 = C;
          const float alpha = c.alpha, beta = c.beta;
          cpu::gemm_16(kBlas, t, ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta,
                       C.data(), ldc);
          auto r = [t](float x) {
            return double(t == DType::kBF16 ? bf16_to_f32(f32_to_bf16(x))
                                            : f16_to_f32(f32_to_f16(x)));
          };
          double worst = 0;
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) {
              double s = 0;
              for (int64_t k = 0; k < K; ++k)
                s += r(ta ? A[k * lda + i] : A[i * lda + k]) *
                     r(tb ? B[j * ldb + k] : B[k * ldb + j]);
              const double want = alpha * s + beta * double(C0[i * ldc + j]);
              worst = std::max(worst, std::abs(C[i * ldc + j] - want));
            }
          // Only f32 accumulation rounding remains (unrounded inputs would
          // be off by ~1e-2 here).
          EXPECT_LT(worst, 2e-4) << dtype_name(t) << " ta " << ta << " tb " << tb << " " << M
                                 << " x " << N << " x " << K;
          // Padding between rows of C is untouched.
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = N; j < ldc; ++j) EXPECT_EQ(C[i * ldc + j], C0[i * ldc + j]);
          // B given as its 16-bit values (a weight held in 16 bits; B not
          // read): bit for bit the same products, with ldb as above and
          // packed (which the bf16 path reads in place).
          for (const bool packed : {false, true}) {
            const int64_t ldb16 = packed ? (tb ? K : N) : ldb;
            std::vector<uint16_t> B16((tb ? N : K) * ldb16);
            for (int64_t r0 = 0; r0 < (tb ? N : K); ++r0)
              for (int64_t c0 = 0; c0 < (tb ? K : N); ++c0) {
                const float x = B[r0 * ldb + c0];
                B16[r0 * ldb16 + c0] = t == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
              }
            std::vector<float> C16 = C0;
            cpu::gemm_16(kBlas, t, ta, tb, M, N, K, alpha, A.data(), lda, nullptr, ldb16, beta,
                         C16.data(), ldc, B16.data());
            EXPECT_EQ(0, std::memcmp(C16.data(), C.data(), C.size() * sizeof(float)))
                << dtype_name(t) << " ta " << ta << " tb " << tb << " packed " << packed;
          }
        }
  // From the threads of a parallel region at once (as the attention kernel
  // calls it), each its own problem: the same results as one at a time.
  {
    const int64_t n = 24, problems = 8;
    std::vector<std::vector<float>> a(problems), b(problems), one(problems), many(problems);
    for (int64_t p = 0; p < problems; ++p) {
      a[p].resize(n * n), b[p].resize(n * n), one[p].assign(n * n, 0), many[p].assign(n * n, 0);
      for (float& x : a[p]) x = u(gen);
      for (float& x : b[p]) x = u(gen);
      cpu::gemm_16(kBlas, DType::kBF16, false, false, n, n, n, 1.0f, a[p].data(), n, b[p].data(), n,
                   0.0f, one[p].data(), n);
    }
#pragma omp parallel for schedule(static, 1)
    for (int64_t p = 0; p < problems; ++p)
      for (int rep = 0; rep < 20; ++rep)
        cpu::gemm_16(kBlas, DType::kBF16, false, false, n, n, n, 1.0f, a[p].data(), n, b[p].data(),
                     n, 0.0f, many[p].data(), n);
    for (int64_t p = 0; p < problems; ++p) EXPECT_EQ(many[p], one[p]) << "problem " << p;
  }
  // Through gemm<float> with 16-bit inputs configured, and without.
  std::vector<float> a = {1.00390625f}, b = {1.0f}, c = {0.0f};  // 1 + 2^-8: not a bf16 value
  cpu::gemm<float>(cpu::GemmConfig{kBlas, DType::kBF16}, false, false, 1, 1, 1, 1.0f, a.data(), 1,
                   b.data(), 1, 0.0f, c.data(), 1);
  EXPECT_EQ(c[0], 1.0f);
  cpu::gemm<float>(cpu::GemmConfig{kBlas}, false, false, 1, 1, 1, 1.0f, a.data(), 1, b.data(), 1,
                   0.0f, c.data(), 1);
  EXPECT_EQ(c[0], 1.00390625f);
  EXPECT_GT(cpu::measure_gemm_gflops(kBlas, DType::kF16, 64, 2), 0);
}

// A linear's backward with bf16 inputs rounds dout once for both of its
// products (round_shared_operand): bit for bit the two products made separately, each
// rounding its own operands, with the weight given as f32 and as its 16-bit
// values; the LM head's (matmul_nt_backward) alike.
TEST(Gemm, BackwardRoundsDoutOnceForBothProducts) {
  if (!cpu::gemm_16_uses_bf16_matmul(DType::kBF16)) GTEST_SKIP() << "no bf16 matmul on this CPU";
  std::mt19937 gen(9);
  std::uniform_real_distribution<float> u(-1, 1);
  const int64_t N = 37, C = 24, OC = 40;
  auto fill = [&](std::vector<float>& v, int64_t n) {
    v.resize(static_cast<size_t>(n));
    for (float& x : v) x = u(gen);
  };
  std::vector<float> dout, inp, w, dinp0, dw0;
  fill(dout, N * OC), fill(inp, N * C), fill(w, C * OC), fill(dinp0, N * C), fill(dw0, C * OC);
  std::vector<uint16_t> w16(w.size());
  for (size_t i = 0; i < w.size(); ++i) w16[i] = f32_to_bf16(w[i]);
  const cpu::GemmConfig g{kBlas, DType::kBF16};
  for (const bool sixteen : {false, true}) {
    const Weight<float> weight =
        sixteen ? Weight<float>(w16.data(), DType::kBF16) : Weight<float>(w.data());
    // matmul_backward: dinp += dout W^T, dW += inp^T dout.
    std::vector<float> dinp = dinp0, dw = dw0, want_dinp = dinp0, want_dw = dw0;
    cpu::matmul_backward<float>(g, dinp.data(), dw.data(), nullptr, dout.data(), inp.data(), weight,
                                N, C, OC, GradWrite::kAdd);
    cpu::gemm_16(kBlas, DType::kBF16, false, true, N, C, OC, 1.0f, dout.data(), OC,
                 sixteen ? nullptr : w.data(), OC, 1.0f, want_dinp.data(), C,
                 sixteen ? w16.data() : nullptr);
    cpu::gemm_16(kBlas, DType::kBF16, true, false, C, OC, N, 1.0f, inp.data(), C, dout.data(), OC,
                 1.0f, want_dw.data(), OC);
    EXPECT_EQ(dinp, want_dinp) << "16-bit weight " << sixteen;
    EXPECT_EQ(dw, want_dw) << "16-bit weight " << sixteen;
    // GradWrite::kSet: dinp = dout W^T whatever it held (beta 0), with and
    // without the weight's gradient beside it (dout rounded once for both).
    for (const bool with_dw : {true, false}) {
      std::vector<float> set = dinp0, want_set(dinp0.size(), 0.0f), dw2 = dw0;
      cpu::matmul_backward<float>(g, set.data(), with_dw ? dw2.data() : nullptr, nullptr,
                                  dout.data(), inp.data(), weight, N, C, OC, GradWrite::kSet);
      cpu::gemm_16(kBlas, DType::kBF16, false, true, N, C, OC, 1.0f, dout.data(), OC,
                   sixteen ? nullptr : w.data(), OC, 0.0f, want_set.data(), C,
                   sixteen ? w16.data() : nullptr);
      EXPECT_EQ(set, want_set) << "kSet, 16-bit weight " << sixteen << ", dW " << with_dw;
      if (with_dw) {
        EXPECT_EQ(dw2, want_dw) << "kSet's dW, 16-bit weight " << sixteen;
      }
    }
    // matmul_nt_backward (W is V x C): dinp += dout W, dW += dout^T inp.
    const int64_t V = OC;
    dinp = dinp0, want_dinp = dinp0;
    std::vector<float> dwt(static_cast<size_t>(V * C), 0.5f), want_dwt = dwt;
    cpu::matmul_nt_backward<float>(g, dinp.data(), dwt.data(), dout.data(), inp.data(), weight, N,
                                   C, V);
    cpu::gemm_16(kBlas, DType::kBF16, false, false, N, C, V, 1.0f, dout.data(), V,
                 sixteen ? nullptr : w.data(), C, 1.0f, want_dinp.data(), C,
                 sixteen ? w16.data() : nullptr);
    cpu::gemm_16(kBlas, DType::kBF16, true, false, V, C, N, 1.0f, dout.data(), V, inp.data(), C,
                 1.0f, want_dwt.data(), C);
    EXPECT_EQ(dinp, want_dinp) << "nt, 16-bit weight " << sixteen;
    EXPECT_EQ(dwt, want_dwt) << "nt, 16-bit weight " << sixteen;
    // dout handed over as its bf16 twin alone (the cross-entropy's
    // gradient written in bf16): the same products, bit for bit, both
    // together and each alone.
    std::vector<uint16_t> dout16(dout.size());
    for (size_t i = 0; i < dout.size(); ++i) dout16[i] = f32_to_bf16(dout[i]);
    Input<float> twin(nullptr, dout16.data());
    twin.written = true;
    for (const int which : {3, 1, 2}) {
      std::vector<float> di = dinp0, dwt2(static_cast<size_t>(V * C), 0.5f);
      cpu::matmul_nt_backward<float>(g, (which & 1) ? di.data() : nullptr,
                                     (which & 2) ? dwt2.data() : nullptr, twin, inp.data(), weight,
                                     N, C, V);
      if (which & 1) {
        EXPECT_EQ(di, want_dinp) << "nt twin, 16-bit weight " << sixteen;
      }
      if (which & 2) {
        EXPECT_EQ(dwt2, want_dwt) << "nt twin, 16-bit weight " << sixteen;
      }
    }
  }
  // With a bias: its gradient is dout's column sums in f32, each column
  // summed in row order and added to what dbias held (not the rounded
  // dout's), the products as before. OC spans several column blocks, the
  // last partial.
  {
    const int64_t OC2 = 150;
    std::vector<float> d2, w2, db0;
    fill(d2, N * OC2), fill(w2, C * OC2), fill(db0, OC2);
    std::vector<float> want_db = db0;
    for (int64_t o = 0; o < OC2; ++o) {
      float acc = 0;
      for (int64_t n = 0; n < N; ++n) acc += d2[static_cast<size_t>(n * OC2 + o)];
      want_db[static_cast<size_t>(o)] += acc;
    }
    std::vector<float> di(static_cast<size_t>(N * C)), dw(static_cast<size_t>(C * OC2), 0.0f),
        db = db0;
    std::vector<float> want_di(di.size()), want_dw(dw.size(), 0.0f);
    cpu::matmul_backward<float>(g, di.data(), dw.data(), db.data(), d2.data(), inp.data(),
                                Weight<float>(w2.data()), N, C, OC2, GradWrite::kSet);
    cpu::gemm_16(kBlas, DType::kBF16, false, true, N, C, OC2, 1.0f, d2.data(), OC2, w2.data(), OC2,
                 0.0f, want_di.data(), C);
    cpu::gemm_16(kBlas, DType::kBF16, true, false, C, OC2, N, 1.0f, inp.data(), C, d2.data(), OC2,
                 1.0f, want_dw.data(), OC2);
    EXPECT_EQ(db, want_db) << "bias gradient";
    EXPECT_EQ(di, want_di) << "input gradient beside the bias's";
    EXPECT_EQ(dw, want_dw) << "weight gradient beside the bias's";
  }
  // A twin where the GEMMs do not read bf16 operands is refused by name.
  std::vector<uint16_t> d16(static_cast<size_t>(N * OC));
  std::vector<float> di(static_cast<size_t>(N * C));
  Input<float> twin(nullptr, d16.data());
  twin.written = true;
  try {
    cpu::matmul_nt_backward<float>(cpu::GemmConfig{kBlas}, di.data(), nullptr, twin, nullptr,
                                   Weight<float>(w.data()), N, C, OC);
    ADD_FAILURE() << "a bf16 dout on f32 GEMMs was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a bf16 output gradient needs bf16 GEMM inputs"),
              std::string::npos)
        << e.what();
  }
}

// A linear's forward with bf16 inputs adds its bias in the matmul's
// epilogue: the rounded inputs' products in double plus the bias, to f32
// accumulation's rounding, with the weight as f32 and as 16-bit values.
TEST(Gemm, ForwardAddsTheBiasInTheEpilogue) {
  if (!cpu::gemm_16_uses_bf16_matmul(DType::kBF16)) GTEST_SKIP() << "no bf16 matmul on this CPU";
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-1, 1);
  const int64_t N = 29, C = 48, OC = 36;
  std::vector<float> inp(N * C), w(C * OC), bias(OC);
  for (float& x : inp) x = u(gen);
  for (float& x : w) x = u(gen);
  for (float& x : bias) x = 4 * u(gen);
  std::vector<uint16_t> w16(w.size());
  for (size_t i = 0; i < w.size(); ++i) w16[i] = f32_to_bf16(w[i]);
  auto r = [](float x) { return double(bf16_to_f32(f32_to_bf16(x))); };
  for (const bool sixteen : {false, true}) {
    const Weight<float> weight =
        sixteen ? Weight<float>(w16.data(), DType::kBF16) : Weight<float>(w.data());
    std::vector<float> out(N * OC, std::nanf(""));  // overwritten, never read
    cpu::matmul_forward<float>(cpu::GemmConfig{kBlas, DType::kBF16}, out.data(), inp.data(), weight,
                               bias.data(), N, C, OC);
    double worst = 0;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < OC; ++j) {
        double want = bias[j];
        for (int64_t k = 0; k < C; ++k) want += r(inp[i * C + k]) * r(w[k * OC + j]);
        const double err = std::abs(out[i * OC + j] - want);
        worst = std::isfinite(err) ? std::max(worst, err) : INFINITY;  // NaN: never written
      }
    EXPECT_LT(worst, 1e-4) << "16-bit weight " << sixteen;
  }
}

// 16-bit weights kept in oneDNN's blocked layout (WeightPacks): the same
// products as from the weights as stored, forward and backward, at shapes
// the blocks do not divide; made once and reused until cleared, then made
// again from the weights' new values.
TEST(Gemm, WeightPacksKeepTheBlockedLayoutUntilCleared) {
  if (!cpu::gemm_16_uses_bf16_matmul(DType::kBF16)) GTEST_SKIP() << "no bf16 matmul on this CPU";
  std::unique_ptr<WeightPacks> packs = cpu::make_weight_packs();
  ASSERT_NE(packs, nullptr);
  std::mt19937 gen(13);
  std::uniform_real_distribution<float> u(-1, 1);
  const int64_t N = 45, C = 72, OC = 88;
  std::vector<float> inp(N * C), dout(N * OC), bias(OC);
  std::vector<uint16_t> w16(C * OC);
  auto draw = [&] {
    for (uint16_t& x : w16) x = f32_to_bf16(u(gen));
  };
  for (float& x : inp) x = u(gen);
  for (float& x : dout) x = u(gen);
  for (float& x : bias) x = u(gen);
  draw();
  const cpu::GemmConfig g{kBlas, DType::kBF16};
  struct Out {
    std::vector<float> y, dinp, ynt, dinp_nt;
  };
  auto run = [&](const Weight<float>& w) {
    Out o{std::vector<float>(N * OC), std::vector<float>(N * C, 0.25f), std::vector<float>(N * C),
          std::vector<float>(N * C, -0.5f)};
    cpu::matmul_forward<float>(g, o.y.data(), inp.data(), w, bias.data(), N, C, OC);
    cpu::matmul_backward<float>(g, o.dinp.data(), nullptr, nullptr, dout.data(), inp.data(), w, N,
                                C, OC, GradWrite::kAdd);
    // The LM head's shapes: W is V x C with V = C here, read transposed.
    cpu::matmul_nt_forward<float>(g, o.ynt.data(), inp.data(), w, N, C, C);
    cpu::matmul_nt_backward<float>(g, o.dinp_nt.data(), nullptr, inp.data(), inp.data(), w, N, C,
                                   C);
    return o;
  };
  auto expect_same = [](const Out& a, const Out& b, const char* when) {
    EXPECT_EQ(a.y, b.y) << when;
    EXPECT_EQ(a.dinp, b.dinp) << when;
    EXPECT_EQ(a.ynt, b.ynt) << when;
    EXPECT_EQ(a.dinp_nt, b.dinp_nt) << when;
  };
  const Weight<float> plain(w16.data(), DType::kBF16);
  const Weight<float> packed(w16.data(), DType::kBF16, packs.get());
  EXPECT_EQ(packs->bytes(), 0u);
  expect_same(run(packed), run(plain), "first use");
  const size_t bytes = packs->bytes();
  EXPECT_GE(bytes, 2 * w16.size() * sizeof(uint16_t)) << "a layout for each direction";
  expect_same(run(packed), run(plain), "kept");
  EXPECT_EQ(packs->bytes(), bytes) << "reused, not made again";
  // The owner writes the weights and clears: the next products read them.
  const Out before = run(plain);
  draw();
  packs->clear();
  const Out after = run(plain);
  EXPECT_NE(after.y, before.y);
  expect_same(run(packed), after, "after clear");
  EXPECT_EQ(packs->bytes(), bytes);
}

}  // namespace
}  // namespace loom
