// The CUDA backend's process state, staging of host pointers and GEMMs.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>

#include "loom/kernels/cuda/cuda_backend.h"
#include "loom/kernels/cuda/cuda_common.cuh"

namespace loom {

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why != nullptr)
      *why = std::string("no CUDA device: cudaGetDeviceCount says ") + cudaGetErrorName(e) + " (" +
             cudaGetErrorString(e) + ")";
    return 0;
  }
  if (n == 0 && why != nullptr) *why = "no CUDA device: the driver reports none";
  return n;
}

int cuda_select_device() {
  std::string why;
  const int n = cuda_device_count(&why);
  LOOM_CHECK_KIND(kConfig, n > 0, "device: cuda, but this machine has {}", why);
  int local = 0;
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* v = std::getenv(var)) {
      local = std::atoi(v);
      break;
    }
  return local % n;
}

std::string cuda_device_description(int device) {
  cudaDeviceProp p{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  const double gib = static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0);
  return format("{} (sm_{}{}, {} GiB)", p.name, p.major, p.minor, std::round(gib * 10) / 10);
}

namespace cuda {

const char* cublasLt_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "a cuBLAS error";
  }
}

const Context& context() {
  static Context ctx;
  static std::once_flag once;
  std::call_once(once, [] {
    ctx.device = cuda_select_device();
    LOOM_CUDA_CHECK(cudaSetDevice(ctx.device));
    LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx.stream, cudaStreamNonBlocking));
    // Freed scratch stays in the pool for the next operation.
    cudaMemPool_t pool;
    LOOM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, ctx.device));
    uint64_t keep = UINT64_MAX;
    LOOM_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    LOOM_CUBLAS_CHECK(cublasLtCreate(&ctx.lt));
    ctx.workspace_bytes = size_t{32} << 20;
    LOOM_CUDA_CHECK(cudaMalloc(&ctx.workspace, ctx.workspace_bytes));
  });
  return ctx;
}

Scratch::Scratch(size_t bytes) {
  if (bytes > 0) LOOM_CUDA_CHECK(cudaMallocAsync(&p_, bytes, context().stream));
}
Scratch::~Scratch() {
  if (p_ != nullptr) cudaFreeAsync(p_, context().stream);
}

Args::Args() {
  LOOM_CUDA_CHECK(cudaSetDevice(context().device));
}

void* Args::stage(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return p;
  const uintptr_t page = 4096;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  for (const Range& r : registered_)
    if (r.lo <= lo && hi <= r.hi) return p;  // inside a range this operation registered
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    a.type = cudaMemoryTypeUnregistered;
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return p;
  if (a.type == cudaMemoryTypeHost && a.devicePointer != nullptr) return a.devicePointer;
  // Plain host memory: registered for this operation, merged with any range
  // it overlaps (registrations may not overlap). Registered memory is
  // addressed on the device by its host address (unified addressing).
  Range u{lo, hi};
  for (size_t i = 0; i < registered_.size();) {
    const Range& r = registered_[i];
    if (r.lo < u.hi && u.lo < r.hi) {
      u.lo = std::min(u.lo, r.lo), u.hi = std::max(u.hi, r.hi);
      LOOM_CUDA_CHECK(cudaHostUnregister(reinterpret_cast<void*>(r.lo)));
      registered_.erase(registered_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  LOOM_CUDA_CHECK(
      cudaHostRegister(reinterpret_cast<void*>(u.lo), u.hi - u.lo, cudaHostRegisterMapped));
  registered_.push_back(u);
  void* d = nullptr;
  LOOM_CUDA_CHECK(cudaHostGetDevicePointer(&d, p, 0));
  return d;
}

void Args::release() {
  for (const Range& r : registered_) cudaHostUnregister(reinterpret_cast<void*>(r.lo));
  registered_.clear();
}

void Args::finish() {
  finished_ = true;
  const cudaError_t e = cudaStreamSynchronize(context().stream);
  release();
  LOOM_CUDA_CHECK(e);
}

Args::~Args() {
  if (finished_) return;
  // An operation that threw: wait for what it queued, then release.
  cudaStreamSynchronize(context().stream);
  release();
}

DeviceDropout device_dropout(const DropoutSpec& spec, Args& args, int64_t Tn) {
  DeviceDropout d;
  if (!spec.active()) return d;
  d.active = true;
  d.k0 = spec.stream->key()[0];
  d.k1 = spec.stream->key()[1];
  d.threshold = spec.stream->threshold();
  d.p = spec.stream->p();
  d.sample0 = spec.sample0;
  d.site = spec.site;
  d.positions = args.in(spec.positions, Tn);
  return d;
}

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kF64:
      return CUDA_R_64F;
    default:
      LOOM_FAIL(kInternal, "no GEMM input type {}", dtype_name(t));
  }
}

struct LayoutGuard {
  cublasLtMatrixLayout_t l = nullptr;
  ~LayoutGuard() {
    if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
  }
};

void make_layout(LayoutGuard& g, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                 int batch, int64_t stride) {
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&g.l, type, static_cast<uint64_t>(rows),
                                               static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    int32_t b = batch;
    LOOM_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(g.l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof(b)));
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        g.l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
}

}  // namespace

template <typename T>
void lt_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const void* A, int64_t lda,
             const void* B, int64_t ldb, T beta, T* C, int64_t ldc, DType ab, bool tf32, int batch,
             int64_t sa, int64_t sb, int64_t sc) {
  if (M == 0 || N == 0) return;
  const Context& ctx = context();
  constexpr bool f64 = std::is_same_v<T, double>;
  const cudaDataType_t in_type = f64 ? CUDA_R_64F : cuda_type(ab);
  const cudaDataType_t c_type = f64 ? CUDA_R_64F : CUDA_R_32F;
  const cublasComputeType_t compute =
      f64 ? CUBLAS_COMPUTE_64F
          : (tf32 && ab == DType::kF32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the
  // column-major product of B's buffer (as its first operand) and A's.
  cublasLtMatmulDesc_t desc = nullptr;
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, compute, c_type));
  struct DescGuard {
    cublasLtMatmulDesc_t d;
    ~DescGuard() { cublasLtMatmulDescDestroy(d); }
  } desc_guard{desc};
  const cublasOperation_t op_first = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                                   sizeof(op_first)));
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                                   sizeof(op_second)));
  LayoutGuard la, lb, lc;
  make_layout(la, in_type, tb ? K : N, tb ? N : K, ldb, batch, sb);
  make_layout(lb, in_type, ta ? M : K, ta ? K : M, lda, batch, sa);
  make_layout(lc, c_type, N, M, ldc, batch, sc);

  cublasLtMatmulPreference_t pref = nullptr;
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
  } pref_guard{pref};
  const uint64_t ws = ctx.workspace_bytes;
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // The alignment each operand really has (the heuristic assumes 256 bytes
  // otherwise): the largest power of two up to 256 dividing its address
  // and its rows' and batches' strides in bytes.
  const size_t es = f64 ? 8 : (ab == DType::kF32 ? 4 : 2), cs = f64 ? 8 : 4;
  auto align = [](const void* p, size_t elem, std::initializer_list<int64_t> strides) {
    uint32_t a = 256;
    auto fit = [&](uint64_t v) {
      while (a > 1 && v % a != 0) a /= 2;
    };
    fit(reinterpret_cast<uintptr_t>(p));
    for (int64_t s : strides) fit(static_cast<uint64_t>(s) * elem);
    return a;
  };
  const uint32_t al_first = align(B, es, {ldb, sb}), al_second = align(A, es, {lda, sa}),
                 al_c = align(C, cs, {ldc, sc});
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_first, sizeof(al_first)));
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_second, sizeof(al_second)));
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  LOOM_CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(ctx.lt, desc, la.l, lb.l, lc.l, lc.l, pref, 1, &heur, &found));
  LOOM_CHECK(found > 0, "cuBLASLt has no algorithm for a {} x {} x {} GEMM ({} inputs, batch {})",
             M, N, K, f64 ? "f64" : dtype_name(ab), batch);
  LOOM_CUBLAS_CHECK(cublasLtMatmul(ctx.lt, desc, &alpha, B, la.l, A, lb.l, &beta, C, lc.l, C, lc.l,
                                   &heur.algo, ctx.workspace, ctx.workspace_bytes, ctx.stream));
}

template void lt_gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const void*, int64_t,
                             const void*, int64_t, float, float*, int64_t, DType, bool, int,
                             int64_t, int64_t, int64_t);
template void lt_gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const void*, int64_t,
                              const void*, int64_t, double, double*, int64_t, DType, bool, int,
                              int64_t, int64_t, int64_t);

}  // namespace cuda
}  // namespace loom
