// What the CUDA backend's translation units share: the process's context
// (device, stream, cuBLASLt handle and workspace), error checks, the staging
// of host pointers, device-side Philox and 16-bit conversions.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/kernels/types.h"

namespace loom::cuda {

#define LOOM_CUDA_CHECK(expr)                                               \
  do {                                                                      \
    const cudaError_t loom_err_ = (expr);                                   \
    LOOM_CHECK(loom_err_ == cudaSuccess, "CUDA: {} failed: {} ({})", #expr, \
               cudaGetErrorName(loom_err_), cudaGetErrorString(loom_err_)); \
  } while (0)
#define LOOM_CUBLAS_CHECK(expr)                                                     \
  do {                                                                              \
    const cublasStatus_t loom_st_ = (expr);                                         \
    LOOM_CHECK(loom_st_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt: {} failed: {}", #expr, \
               cublasLt_status_name(loom_st_));                                     \
  } while (0)
// After a kernel launch: a bad configuration is reported at once.
#define LOOM_CUDA_LAUNCHED() LOOM_CUDA_CHECK(cudaGetLastError())

const char* cublasLt_status_name(cublasStatus_t s);

// The process's CUDA state, made once on the selected device.
struct Context {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;  // cuBLASLt's
  size_t workspace_bytes = 0;
};
const Context& context();

// Scratch device memory for one operation, freed in stream order.
class Scratch {
 public:
  Scratch() = default;
  explicit Scratch(size_t bytes);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  Scratch(Scratch&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  Scratch& operator=(Scratch&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  template <typename U>
  U* as() const {
    return static_cast<U*>(p_);
  }

 private:
  void* p_ = nullptr;
};

// One operation's pointer arguments made usable on the device: device and
// managed memory pass through, registered host memory by its device alias,
// plain host memory is registered (page-locked and mapped) for the
// operation, so the kernels read and write it in place (overlapping ranges,
// such as two gradients in one buffer, are merged into one registration).
// finish() synchronises the stream and releases the registrations: every
// operation of the backend completes before it returns. The constructor
// makes the backend's device the calling thread's.
class Args {
 public:
  Args();
  Args(const Args&) = delete;
  Args& operator=(const Args&) = delete;
  ~Args();
  template <typename U>
  const U* in(const U* p, int64_t n) {
    return static_cast<const U*>(stage(const_cast<U*>(p), sizeof(U) * static_cast<size_t>(n)));
  }
  template <typename U>
  U* inout(U* p, int64_t n) {
    return static_cast<U*>(stage(p, sizeof(U) * static_cast<size_t>(n)));
  }
  void finish();

 private:
  void* stage(void* p, size_t bytes);
  void release();
  struct Range {
    uintptr_t lo, hi;  // page-aligned
  };
  std::vector<Range> registered_;
  bool finished_ = false;
};

// Blocks and threads for n elements, a grid-stride loop in the kernel.
inline unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 4 ? 65535 * 4 : b));
}

// Threads per block of the element-wise kernels, and their grid-stride loop.
constexpr int kThreads = 256;
#define LOOM_GRID_STRIDE(i, n)                                              \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{blockDim.x} * gridDim.x)

// Launches an element-wise kernel over n elements on the backend's stream.
template <typename K, typename... A>
void launch(K kernel, int64_t n, A... a) {
  if (n == 0) return;
  kernel<<<grid_for(n, kThreads), kThreads, 0, context().stream>>>(a...);
  LOOM_CUDA_LAUNCHED();
}

// ---- device helpers -----------------------------------------------------------

__device__ __forceinline__ void philox_round(uint32_t c[4], uint32_t k0, uint32_t k1) {
  const uint32_t lo0 = 0xD2511F53u * c[0], hi0 = __umulhi(0xD2511F53u, c[0]);
  const uint32_t lo1 = 0xCD9E8D57u * c[2], hi1 = __umulhi(0xCD9E8D57u, c[2]);
  const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
  c[0] = n0, c[1] = lo1, c[2] = n2, c[3] = lo0;
}
// philox4x32 (core/rng.h) word `word` of counter c under (k0, k1).
__device__ __forceinline__ uint32_t philox_word(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                uint32_t k0, uint32_t k1, int word) {
  uint32_t c[4] = {c0, c1, c2, c3};
  for (int r = 0; r < 10; ++r) {
    philox_round(c, k0, k1);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c[word];
}

// A dropout spec as a kernel takes it (by value): DropoutStream::row's
// draw for element c of (sample, site, position) row.
struct DeviceDropout {
  bool active = false;
  uint32_t k0 = 0, k1 = 0, threshold = 0;
  float p = 0;  // kept elements scale by 1 / (1 - p), computed in T as on the CPU
  uint64_t sample0 = 0;
  uint32_t site = 0;
  const int32_t* positions = nullptr;  // device-usable, or null
};
DeviceDropout device_dropout(const DropoutSpec& spec, Args& args, int64_t Tn);

template <typename T>
__device__ __forceinline__ T keep_of(const DeviceDropout& d, uint64_t sample, uint32_t site,
                                     uint32_t position, int64_t c) {
  if (!d.active) return T(1);
  const uint32_t hi = static_cast<uint32_t>(sample >> 32) << 18;
  const uint32_t w =
      philox_word(static_cast<uint32_t>(sample), site, position, hi + static_cast<uint32_t>(c / 4),
                  d.k0, d.k1, static_cast<int>(c % 4));
  return w >= d.threshold ? T(1) / (T(1) - T(d.p)) : T(0);
}

__device__ __forceinline__ float widen16(uint16_t x, bool bf16) {
  return bf16 ? __bfloat162float(__ushort_as_bfloat16(x)) : __half2float(__ushort_as_half(x));
}
__device__ __forceinline__ uint16_t narrow16(float x, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}

// Sum over a block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. `shared` holds 32 values.
template <typename U>
__device__ U block_sum(U v, U* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  U r = lane < warps ? shared[lane] : U(0);
  for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
  return r;
}
template <typename U>
__device__ U block_max(U v, U* shared) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  U r = lane < warps ? shared[lane] : U(-INFINITY);
  for (int o = 16; o > 0; o >>= 1) r = max(r, __shfl_xor_sync(0xffffffffu, r, o));
  return r;
}

// ---- GEMM (cuBLASLt) ------------------------------------------------------------

// Row-major C (M, N) = alpha op(A) op(B) + beta C for `batch` matrices at
// strides sa, sb, sc (elements). A and B have type `ab` (kF32 / kBF16 /
// kF16; for T = double, f64), C has T's type.
template <typename T>
void lt_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const void* A, int64_t lda,
             const void* B, int64_t ldb, T beta, T* C, int64_t ldc, DType ab, bool tf32,
             int batch = 1, int64_t sa = 0, int64_t sb = 0, int64_t sc = 0);

}  // namespace loom::cuda
