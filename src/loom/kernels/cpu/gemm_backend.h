// The GEMM backends behind cpu::gemm<float>: OpenBLAS (cblas_sgemm) and
// oneDNN (dnnl_sgemm, its OpenMP build, which shares loom's thread pool). One
// backend serves the whole process, chosen once at start (`kernels.gemm`):
// every f32 GEMM, the attention core's block products included, goes
// through it. f64 GEMMs (the finite-difference tests) always use OpenBLAS.
#pragma once

#include <string>
#include <vector>

namespace loom::cpu {

enum class GemmBackend { kOpenBlas, kOneDnn };

const char* gemm_backend_name(GemmBackend b);  // "openblas", "onednn"
// Whether this build links the backend (oneDNN: configured with LOOM_ONEDNN).
bool gemm_backend_available(GemmBackend b);
// The backend in use (OpenBLAS until set).
GemmBackend gemm_backend();
// Selects the backend; throws Error(kUnsupported) when it is not in this build.
void set_gemm_backend(GemmBackend b);

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

// C (M, N) = A (M, K) @ B (K, N) through that primitive with the inputs
// rounded to bf16 (round to nearest even) and f32 accumulation: the same
// numbers a bf16 GEMM gives, for tests against an f32 reference.
void matmul_bf16(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K);

}  // namespace loom::cpu
