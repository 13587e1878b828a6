// Matrix multiplication through the GEMM backend a GemmConfig names
// (gemm_backend.h: OpenBLAS or oneDNN, inputs as they are or rounded to 16 bits). Weights are
// stored (in, out), as GPT-2's Conv1D does, so a layer's forward is one row-major GEMM with no
// transpose.
#pragma once

#include <cstdint>
#include <type_traits>

#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/types.h"

namespace loom::cpu {

// C (M, N) = alpha * op(A) @ op(B) + beta * C, row-major; op = transpose when trans_*.
template <typename T>
void gemm(const GemmConfig& g, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
          const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// out (N, OC) = inp (N, C) @ weight (C, OC) + bias (OC); bias may be null.
// An input with a bf16 twin (types.h; bf16 inputs on the bf16 matmul only)
// is rounded into the twin, which the GEMM then reads.
template <typename T>
void matmul_forward(const GemmConfig& g, T* out, InputArg<T> inp, WeightArg<T> weight,
                    const T* bias, int64_t N, int64_t C, int64_t OC);

// Accumulates: dinp (N, C) += dout @ weight^T; dweight (C, OC) += inp^T @ dout;
// dbias (OC) += column sums of dout. Any of dinp, dweight, dbias may be
// null (then weight, or inp, is not read). An input with a bf16 twin is
// read from the twin.
template <typename T>
void matmul_backward(const GemmConfig& g, T* dinp, T* dweight, T* dbias, const T* dout,
                     InputArg<T> inp, WeightArg<T> weight, int64_t N, int64_t C, int64_t OC,
                     GradWrite dinp_write);

// The tied LM head: out (N, V) = inp (N, C) @ weight^T with weight (V, C).
template <typename T>
void matmul_nt_forward(const GemmConfig& g, T* out, const T* inp, WeightArg<T> weight, int64_t N,
                       int64_t C, int64_t V);

// Accumulates: dinp (N, C) += dout (N, V) @ weight; dweight (V, C) += dout^T @ inp.
// Either may be null (then weight, or inp, is not read). dout may be its
// bf16 twin alone (r16 written; bf16 inputs on the bf16 matmul): both
// products multiply it as it is.
template <typename T>
void matmul_nt_backward(const GemmConfig& g, T* dinp, T* dweight, InputArg<T> dout, const T* inp,
                        WeightArg<T> weight, int64_t N, int64_t C, int64_t V);

}  // namespace loom::cpu
