#include "loom/kernels/cpu/matmul.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <type_traits>

#ifdef LOOM_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#endif

#include "loom/core/error.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/cpu/gemm_census.h"
#include "loom/kernels/cpu/precision.h"

namespace loom::cpu {

template <>
void gemm<float>(const GemmConfig& g, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                 float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                 float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (g.inputs != DType::kF32) {
    gemm_16(g.backend, g.inputs, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  gemm_f32(g.backend, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void gemm_f32(GemmBackend backend, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
              const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
              int64_t ldc) {
  if (M == 0 || N == 0) return;
  const GemmCounted counted({backend, DType::kF32, ta, tb, M, N, K, lda, ldb, ldc, beta != 0.0f});
#ifdef LOOM_HAVE_ONEDNN
  if (backend == GemmBackend::kOneDnn) {
    if (f32_matmul_form(ta, tb, M, N, K) && omp_get_level() == 0) {
      matmul_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
      return;
    }
    // Row-major, as cblas with CblasRowMajor.
    const dnnl_status_t st =
        dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    LOOM_CHECK(st == dnnl_success, "dnnl_sgemm({} x {} x {}) failed with status {}", M, N, K,
               static_cast<int>(st));
    return;
  }
#else
  (void)backend;
#endif
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <>
void gemm<double>(const GemmConfig&, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                  double alpha, const double* A, int64_t lda, const double* B, int64_t ldb,
                  double beta, double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
              K, alpha, A, lda, B, ldb, beta, C, ldc);
}

namespace {

// gemm with B a weight: a 16-bit one goes to gemm_16 as it is.
template <typename T>
void gemm_weight(const GemmConfig& g, bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha,
                 const T* A, int64_t lda, const Weight<T>& B, int64_t ldb, T beta, T* C,
                 int64_t ldc) {
  if (B.w16 == nullptr) {
    gemm<T>(g, ta, tb, M, N, K, alpha, A, lda, B.data, ldb, beta, C, ldc);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (M == 0 || N == 0) return;
    gemm_16(g.backend, B.t, ta, tb, M, N, K, alpha, A, lda, nullptr, ldb, beta, C, ldc, B.w16,
            nullptr, nullptr, B.packs);
  } else {
    LOOM_FAIL(kUnsupported, "16-bit weights need f32 layers");
  }
}

}  // namespace

template <typename T>
void matmul_forward(const GemmConfig& g, T* out, InputArg<T> input, WeightArg<T> weight,
                    const T* bias, int64_t N, int64_t C, int64_t OC) {
  const T* inp = input.data;
  if constexpr (std::is_same_v<T, float>) {
    const bool bf16 =
        gemm_16_uses_bf16_matmul(g.inputs) && (weight.w16 == nullptr || weight.t == g.inputs);
    if (input.r16 != nullptr) {
      LOOM_CHECK(bf16 && g.inputs == DType::kBF16,
                 "matmul_forward: a bf16 input twin needs bf16 GEMM inputs on the bf16 matmul");
      if (!input.written) round_to_16(inp, input.r16, N * C, DType::kBF16);
    }
    // bf16 inputs: the bias added in the matmul's epilogue, not copied
    // into every row first; a twin read where the record keeps it.
    if ((bias != nullptr || input.r16 != nullptr) && N > 0 && OC > 0 && C > 0 && bf16) {
      gemm_16(g.backend, g.inputs, false, false, N, OC, C, 1.0f, inp, C, weight.data, OC, 0.0f, out,
              OC, weight.w16, input.r16, bias, weight.packs);
      return;
    }
  }
  if (bias != nullptr) {
#pragma omp parallel for
    for (int64_t n = 0; n < N; ++n) std::copy(bias, bias + OC, out + n * OC);
  }
  gemm_weight<T>(g, false, false, N, OC, C, T(1), inp, C, weight, OC, bias ? T(1) : T(0), out, OC);
}

namespace {

// Whether dout, read by both products of a backward, is rounded to bf16 once
// for the two: bf16 inputs through the bf16 matmul, f32 layers, both
// products wanted and none empty.
template <typename T>
bool share_dout(const GemmConfig& g, const void* dinp, const void* dweight, int64_t N, int64_t C,
                int64_t OC) {
  return std::is_same_v<T, float> && dinp != nullptr && dweight != nullptr && N > 0 && C > 0 &&
         OC > 0 && gemm_16_uses_bf16_matmul(g.inputs);
}

}  // namespace

template <typename T>
void matmul_backward(const GemmConfig& g, T* dinp, T* dweight, T* dbias, const T* dout,
                     InputArg<T> input, WeightArg<T> weight, int64_t N, int64_t C, int64_t OC,
                     GradWrite dinp_write) {
  const T* inp = input.data;
  const T dinp_beta = dinp_write == GradWrite::kSet ? T(0) : T(1);
  if (dinp != nullptr && dinp_write == GradWrite::kSet && OC == 0) {
    std::fill_n(dinp, N * C, T(0));  // a product over nothing
    dinp = nullptr;
  }
  if constexpr (std::is_same_v<T, float>) {
    LOOM_CHECK(
        input.r16 == nullptr || (g.inputs == DType::kBF16 && gemm_16_uses_bf16_matmul(g.inputs)),
        "matmul_backward: a bf16 input twin needs bf16 GEMM inputs on the bf16 matmul");
    if (share_dout<T>(g, dinp, dweight, N, C, OC) &&
        (weight.w16 == nullptr || weight.t == g.inputs)) {
      const uint16_t* dout16 = round_shared_operand(dout, N * OC);
      if (weight.w16 != nullptr)
        gemm_16(g.backend, g.inputs, false, true, N, C, OC, 1.0f, nullptr, OC, nullptr, OC,
                dinp_beta, dinp, C, weight.w16, dout16, nullptr, weight.packs);
      else
        gemm_16(g.backend, g.inputs, false, true, N, C, OC, 1.0f, nullptr, OC, weight.data, OC,
                dinp_beta, dinp, C, nullptr, dout16);
      gemm_16(g.backend, g.inputs, true, false, C, OC, N, 1.0f, inp, C, nullptr, OC, 1.0f, dweight,
              OC, dout16, input.r16);
      dinp = nullptr, dweight = nullptr;
    }
    if (dweight != nullptr && input.r16 != nullptr && N > 0 && C > 0 && OC > 0) {
      gemm_16(g.backend, g.inputs, true, false, C, OC, N, 1.0f, nullptr, C, dout, OC, 1.0f, dweight,
              OC, nullptr, input.r16);
      dweight = nullptr;
    }
  }
  if (dinp != nullptr)
    gemm_weight<T>(g, false, true, N, C, OC, T(1), dout, OC, weight, OC, dinp_beta, dinp, C);
  if (dweight != nullptr)
    gemm<T>(g, true, false, C, OC, N, T(1), inp, C, dout, OC, T(1), dweight, OC);
  if (dbias == nullptr) return;
  // Column sums, split by column blocks so threads never share an output.
  constexpr int64_t kBlock = 64;
#pragma omp parallel for
  for (int64_t o0 = 0; o0 < OC; o0 += kBlock) {
    int64_t o1 = std::min(OC, o0 + kBlock);
    T acc[kBlock] = {};
    for (int64_t n = 0; n < N; ++n) {
      const T* row = dout + n * OC;
      for (int64_t o = o0; o < o1; ++o) acc[o - o0] += row[o];
    }
    for (int64_t o = o0; o < o1; ++o) dbias[o] += acc[o - o0];
  }
}

template <typename T>
void matmul_nt_forward(const GemmConfig& g, T* out, const T* inp, WeightArg<T> weight, int64_t N,
                       int64_t C, int64_t V) {
  gemm_weight<T>(g, false, true, N, V, C, T(1), inp, C, weight, C, T(0), out, V);
}

template <typename T>
void matmul_nt_backward(const GemmConfig& g, T* dinp, T* dweight, InputArg<T> dout_arg,
                        const T* inp, WeightArg<T> weight, int64_t N, int64_t C, int64_t V) {
  const T* dout = dout_arg.data;
  if constexpr (std::is_same_v<T, float>) {
    const bool bf16 =
        gemm_16_uses_bf16_matmul(g.inputs) && (weight.w16 == nullptr || weight.t == g.inputs);
    // dout in bf16: the twin its producer wrote, or rounded here once for
    // the two products.
    const uint16_t* dout16 = nullptr;
    if (dout_arg.r16 != nullptr) {
      LOOM_CHECK(dout_arg.written && bf16 && g.inputs == DType::kBF16,
                 "matmul_nt_backward: a bf16 output gradient needs bf16 GEMM inputs on the bf16 "
                 "matmul (and the weight in bf16 or f32)");
      dout16 = dout_arg.r16;
    } else if (share_dout<T>(g, dinp, dweight, N, C, V) && bf16) {
      dout16 = round_shared_operand(dout, N * V);
    }
    if (dout16 != nullptr) {
      if (N == 0 || C == 0 || V == 0) return;
      if (dinp != nullptr) {
        if (weight.w16 != nullptr)
          gemm_16(g.backend, g.inputs, false, false, N, C, V, 1.0f, nullptr, V, nullptr, C, 1.0f,
                  dinp, C, weight.w16, dout16, nullptr, weight.packs);
        else
          gemm_16(g.backend, g.inputs, false, false, N, C, V, 1.0f, nullptr, V, weight.data, C,
                  1.0f, dinp, C, nullptr, dout16);
      }
      if (dweight != nullptr)
        gemm_16(g.backend, g.inputs, true, false, V, C, N, 1.0f, nullptr, V, inp, C, 1.0f, dweight,
                C, nullptr, dout16);
      return;
    }
  }
  LOOM_CHECK(dout_arg.r16 == nullptr,
             "matmul_nt_backward: a bf16 output gradient needs f32 layers on the bf16 matmul");
  if (dinp != nullptr)
    gemm_weight<T>(g, false, false, N, C, V, T(1), dout, V, weight, C, T(1), dinp, C);
  if (dweight != nullptr) gemm<T>(g, true, false, V, C, N, T(1), dout, V, inp, C, T(1), dweight, C);
}

#define LOOM_INSTANTIATE(T)                                                                   \
  template void matmul_forward<T>(const GemmConfig&, T*, InputArg<T>, WeightArg<T>, const T*, \
                                  int64_t, int64_t, int64_t);                                 \
  template void matmul_backward<T>(const GemmConfig&, T*, T*, T*, const T*, InputArg<T>,      \
                                   WeightArg<T>, int64_t, int64_t, int64_t, GradWrite);       \
  template void matmul_nt_forward<T>(const GemmConfig&, T*, const T*, WeightArg<T>, int64_t,  \
                                     int64_t, int64_t);                                       \
  template void matmul_nt_backward<T>(const GemmConfig&, T*, T*, InputArg<T>, const T*,       \
                                      WeightArg<T>, int64_t, int64_t, int64_t);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
