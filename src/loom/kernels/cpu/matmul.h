// Matrix multiplication through the GEMM backend in use (gemm_backend.h:
// OpenBLAS or oneDNN). Weights are stored (in, out), as GPT-2's
// Conv1D does, so a layer's forward is one row-major GEMM with no transpose.
#pragma once

#include <cstdint>
#include <type_traits>

#include "loom/core/dtype.h"

namespace loom::cpu {

// A weight matrix as a layer hands it to a GEMM: T values, or, in a 16-bit
// run with 16-bit GEMM inputs, the 16-bit values (type t) the run keeps,
// which the GEMM multiplies without an f32 copy (gemm_backend.h, gemm_16).
template <typename T>
struct Weight {
  const T* data = nullptr;
  const uint16_t* w16 = nullptr;
  DType t = DType::kF32;
  Weight() = default;
  Weight(const T* p) : data(p) {}  // NOLINT: T values convert implicitly
  Weight(const uint16_t* p, DType type) : w16(p), t(type) {}
  // Element i as T (a 16-bit value widened, exactly): for lookups.
  T operator[](int64_t i) const {
    if (w16 == nullptr) return data[i];
    return static_cast<T>(t == DType::kBF16 ? bf16_to_f32(w16[i]) : f16_to_f32(w16[i]));
  }
};
// Weight parameters take T pointers too (the element type comes from the
// other arguments).
template <typename T>
using WeightArg = std::type_identity_t<Weight<T>>;

// C (M, N) = alpha * op(A) @ op(B) + beta * C, row-major; op = transpose when trans_*.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// out (N, OC) = inp (N, C) @ weight (C, OC) + bias (OC); bias may be null.
template <typename T>
void matmul_forward(T* out, const T* inp, WeightArg<T> weight, const T* bias, int64_t N, int64_t C,
                    int64_t OC);

// Accumulates: dinp (N, C) += dout @ weight^T; dweight (C, OC) += inp^T @ dout;
// dbias (OC) += column sums of dout. Any of dinp, dweight, dbias may be
// null (then weight, or inp, is not read).
template <typename T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                     WeightArg<T> weight, int64_t N, int64_t C, int64_t OC);

// The tied LM head: out (N, V) = inp (N, C) @ weight^T with weight (V, C).
template <typename T>
void matmul_nt_forward(T* out, const T* inp, WeightArg<T> weight, int64_t N, int64_t C, int64_t V);

// Accumulates: dinp (N, C) += dout (N, V) @ weight; dweight (V, C) += dout^T @ inp.
// Either may be null (then weight, or inp, is not read).
template <typename T>
void matmul_nt_backward(T* dinp, T* dweight, const T* dout, const T* inp, WeightArg<T> weight,
                        int64_t N, int64_t C, int64_t V);

}  // namespace loom::cpu
