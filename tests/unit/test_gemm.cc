// The GEMM backends: each against a naive double reference for every
// transpose combination, leading dimensions and alpha/beta; kernels.gemm's
// choice and its errors.
#include <gtest/gtest.h>

#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "loom/io/fs.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/cpu/matmul.h"
#include "loom/profile/gemm_peak.h"
#include "loom/train/config.h"
#include "loom/train/gemm_choice.h"
#include "test_util.h"

namespace loom {
namespace {

using test::error_of;

std::vector<cpu::GemmBackend> available() {
  std::vector<cpu::GemmBackend> out;
  for (auto b : {cpu::GemmBackend::kOpenBlas, cpu::GemmBackend::kOneDnn})
    if (cpu::gemm_backend_available(b)) out.push_back(b);
  return out;
}

TEST(Gemm, EveryBackendMatchesANaiveReference) {
  const int64_t M = 37, N = 29, K = 53, pad = 3;
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (cpu::GemmBackend b : available()) {
    cpu::set_gemm_backend(b);
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        // Row-major with leading dimensions larger than the rows need.
        const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
        std::vector<float> A((ta ? K : M) * lda), B((tb ? N : K) * ldb), C(M * ldc);
        for (auto* v : {&A, &B, &C})
          for (float& x : *v) x = u(gen);
        std::vector<float> C0 = C;
        const float alpha = 0.75f, beta = -0.5f;
        cpu::gemm<float>(ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
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
  cpu::set_gemm_backend(cpu::GemmBackend::kOpenBlas);
}

TEST(Gemm, KernelsGemmChoosesAndNamesTheBackend) {
  GemmChoice c = configure_gemm("openblas");
  EXPECT_EQ(cpu::gemm_backend(), cpu::GemmBackend::kOpenBlas);
  EXPECT_HAS(c.describe, "openblas (");
  c = configure_gemm("auto");
  EXPECT_EQ(cpu::gemm_backend(), c.backend);
  if (cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn)) {
    EXPECT_EQ(c.backend, cpu::GemmBackend::kOneDnn);
    EXPECT_HAS(c.describe, "auto: oneDNN whenever this build has it");
    configure_gemm("openblas");
    configure_gemm("onednn");
    EXPECT_EQ(cpu::gemm_backend(), cpu::GemmBackend::kOneDnn);
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
  cpu::set_gemm_backend(cpu::GemmBackend::kOpenBlas);
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
  cpu::set_gemm_backend(cpu::GemmBackend::kOpenBlas);
  const PeakGflops first = machine_peak_gflops(2);
  EXPECT_FALSE(first.cached);
  EXPECT_GT(first.gflops, 0);
  EXPECT_EQ(first.cache_file, (tmp.path / "loom" / "peak_gflops.json").string());
  EXPECT_EQ(cpu::gemm_backend(), cpu::GemmBackend::kOpenBlas);  // restored
  const PeakGflops again = machine_peak_gflops(2);
  EXPECT_TRUE(again.cached);
  EXPECT_EQ(again.gflops, first.gflops);
  EXPECT_EQ(again.backend, first.backend);
  // Another thread count is another key.
  EXPECT_HAS(read_file(first.cache_file), "| 2 threads |");
  unsetenv("XDG_CACHE_HOME");
}

}  // namespace
}  // namespace loom
