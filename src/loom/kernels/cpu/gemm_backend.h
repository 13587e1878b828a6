// The GEMM backends behind cpu::gemm<float>: OpenBLAS (cblas_sgemm) and
// oneDNN (dnnl_sgemm, its OpenMP build, which shares loom's thread pool).
// Which one runs, and whether f32 GEMMs round their inputs to 16 bits first,
// is a GemmConfig that the CPU backend instance holds (`kernels.gemm`,
// `kernels.gemm_inputs`) and passes to every GEMM it runs, the attention
// core's block products included; nothing about it is process-wide. f64
// GEMMs (the finite-difference tests) always use OpenBLAS.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/kernels/types.h"

namespace loom::cpu {

enum class GemmBackend { kOpenBlas, kOneDnn };

const char* gemm_backend_name(GemmBackend b);  // "openblas", "onednn"
// Whether this build links the backend (oneDNN: configured with LOOM_ONEDNN).
bool gemm_backend_available(GemmBackend b);
// Throws Error(kUnsupported) when b is not in this build.
void check_gemm_backend(GemmBackend b);

// What a CPU backend's f32 GEMMs run on: `backend`, with op(A) and op(B)
// rounded to `inputs` first (kF32: as they are, the default; kBF16 or kF16:
// kernels.gemm_inputs 16bit in a 16-bit run).
struct GemmConfig {
  GemmBackend backend = GemmBackend::kOpenBlas;
  DType inputs = DType::kF32;
};

// What each backend runs on this CPU: OpenBLAS's core name (the kernel it
// picked, e.g. "Haswell", "SkylakeX", or the generic "Prescott"), oneDNN's
// instruction set ("avx512_core_bf16", ...).
std::string gemm_backend_isa(GemmBackend b);

// When OpenBLAS runs a generic kernel (it does not know this processor) on a
// CPU with AVX2 or AVX-512: the cause and the fix, in one line; else "".
std::string openblas_misdetection();

// Median GFLOP/s of `reps` square sgemm calls of size n with backend b
// (after one warm-up call).
double measure_sgemm_gflops(GemmBackend b, int n, int reps);

// oneDNN's matmul primitive for (M, K) @ (K, N), row-major, with f32 or
// bf16 inputs (f32 accumulation and output either way): the median GFLOP/s
// of `reps` calls after a warm-up; 0 when this build has no oneDNN. (The
// mixed-precision work runs its GEMMs on this primitive.)
double measure_matmul_gflops(int64_t M, int64_t N, int64_t K, bool bf16, int reps);

// C = alpha op(A) op(B) + beta C, row-major, as cpu::gemm, through backend
// b, inputs as given.
void gemm_f32(GemmBackend b, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
              const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
              int64_t ldc);
// oneDNN's f32 matmul primitive, which gemm_f32 runs on the oneDNN backend
// for the forms where oneDNN's sgemm reads a transposed operand slowly:
// op(B) transposed with K >= N (a linear layer's input gradient, dout
// times its transposed weight, where the layer keeps or widens its width)
// and op(A) transposed with M > N (the weight gradient of a layer that
// narrows, and the LM head's). Measured on AVX-512 at gpt-m's shapes: the
// primitive 1.15-1.45x the sgemm on those, 0.85-0.95x on the other
// transposed forms; the same under an AVX2 cap. A rule of the form alone
// (each dimension at least 64), so every rank and run multiplies alike;
// calls from inside a parallel region, active or not (the attention core's
// block products), keep the sgemm.
bool f32_matmul_form(bool ta, bool tb, int64_t M, int64_t N, int64_t K);
void matmul_f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// The same with op(A) and op(B) rounded to t (kBF16 or kF16) and the
// products accumulated in f32: bf16 through oneDNN's bf16 matmul (the
// f32 operands rounded into 16-bit copies in their stored layout, a
// transposed one described to oneDNN by its strides; the copies live in a
// per-thread scratch kept between calls); f16, or bf16 without oneDNN or on
// a CPU where it refuses bf16, by converting K-tiles of both operands (256
// deep) to their rounded values and accumulating the tiles' f32 GEMMs into C.
// With B16, B is that 16-bit matrix (values in t, same layout and ldb) and
// B is not read: a weight held in 16 bits, multiplied as it is (bf16) or
// widened a K-tile at a time (the tiled path), never copied to f32 whole.
// With packs (from make_weight_packs), B16 is a weight that the bf16 matmul
// reads in oneDNN's blocked layout, reordered on its first use after the
// owner last cleared packs and kept there (the products are the same as
// from B16 as stored). With A16 (bf16 through the bf16
// matmul only), likewise for A; with bias
// (N f32 values; bf16 through the bf16 matmul only, alpha 1) the product
// plus the bias in every row, added in the GEMM's epilogue.
void gemm_16(GemmBackend b, DType t, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
             const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
             int64_t ldc, const uint16_t* B16 = nullptr, const uint16_t* A16 = nullptr,
             const float* bias = nullptr, WeightPacks* packs = nullptr);
// A cache of gemm_16's blocked weights for their owner to clear on every
// write (types.h); null where gemm_16 does not run the bf16 matmul.
std::unique_ptr<WeightPacks> make_weight_packs();
// X (n elements) rounded to bf16 into this thread's scratch for operands
// that several gemm_16 calls read (kept until the thread's next call).
const uint16_t* round_shared_operand(const float* X, int64_t n);
// Which way gemm_16 multiplies t on this machine, in words.
const char* gemm_16_path(DType t);
// What decides whether bf16 GEMM inputs pay on a CPU: the facts below, as
// oneDNN sees the CPU (ONEDNN_MAX_CPU_ISA included).
struct Bf16MatmulFacts {
  std::string isa;      // oneDNN's effective ISA, in its words
  bool onednn = false;  // this build has oneDNN
  bool runs = false;    // oneDNN runs its bf16 matmul here
  bool amx = false;     // on AMX tiles
  bool native = false;  // on the CPU's bf16 instructions (AVX512-BF16 or AMX), not emulated
  bool amd = false;     // an AMD CPU (Zen 4 on are the ones with AVX512-BF16)
};
Bf16MatmulFacts bf16_matmul_facts();
// Whether a bf16 matmul outruns the f32 sgemm by enough to pay for rounding
// its operands, and why (for the log): with AMX tiles (4.9-8.7x at gpt-m's
// shapes), or on an AMD CPU's AVX512-BF16 (1.8-2.1x on Zen 5); not on an
// Intel CPU's AVX512-BF16 without AMX (measured slower end to end). A rule
// of the facts, never a timing.
bool bf16_matmul_pays(const Bf16MatmulFacts& f, std::string* why = nullptr);
// bf16_matmul_pays on this machine.
bool bf16_matmul_pays_here();
// Whether 16-bit inputs of type t run through oneDNN's bf16 matmul (bf16,
// a build with oneDNN, a CPU it runs the primitive on).
bool gemm_16_uses_bf16_matmul(DType t);
// Median GFLOP/s of `reps` n^3 GEMMs with inputs rounded to t (kF32: the
// backend's sgemm) after a warm-up, through backend b.
double measure_gemm_gflops(GemmBackend b, DType t, int n, int reps);

// C (M, N) = A (M, K) @ B (K, N) through that primitive with the inputs
// rounded to bf16 (round to nearest even) and f32 accumulation: the same
// numbers a bf16 GEMM gives, for tests against an f32 reference.
void matmul_bf16(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K);

}  // namespace loom::cpu
