#include "loom/kernels/cpu/gemm_backend.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>

#ifdef LOOM_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/kernels/cpu/matmul.h"

extern "C" char* openblas_get_corename();

namespace loom::cpu {

namespace {
std::atomic<GemmBackend> g_backend{GemmBackend::kOpenBlas};
}  // namespace

const char* gemm_backend_name(GemmBackend b) {
  return b == GemmBackend::kOneDnn ? "onednn" : "openblas";
}

bool gemm_backend_available(GemmBackend b) {
#ifdef LOOM_HAVE_ONEDNN
  (void)b;
  return true;
#else
  return b == GemmBackend::kOpenBlas;
#endif
}

GemmBackend gemm_backend() {
  return g_backend.load(std::memory_order_relaxed);
}

void set_gemm_backend(GemmBackend b) {
  LOOM_CHECK_KIND(kUnsupported, gemm_backend_available(b),
                  "kernels.gemm: {} is not available in this build (configure with "
                  "-DLOOM_ONEDNN=ON and Debian's libdnnl-dev installed)",
                  gemm_backend_name(b));
  g_backend.store(b, std::memory_order_relaxed);
}

std::string gemm_backend_isa(GemmBackend b) {
  if (b == GemmBackend::kOpenBlas) return openblas_get_corename();
#ifdef LOOM_HAVE_ONEDNN
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    default:
      return "other";
  }
#else
  return "not built";
#endif
}

std::string openblas_misdetection() {
  const std::string core = openblas_get_corename();
  // The kernels OpenBLAS falls back to when it does not know a processor.
  const bool generic = core == "Prescott" || core == "Core2" || core == "Penryn" ||
                       core == "Dunnington" || core == "Nehalem" || core == "Atom" ||
                       core == "Unknown";
  if (!generic) return "";
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2");
  if (!avx2 && !avx512) return "";
  return format(
      "OpenBLAS runs its generic '{}' kernel on this CPU, which has {}: this OpenBLAS does not "
      "recognise the processor, and its GEMMs run several times slower; use kernels.gemm: "
      "onednn (or auto), or set OPENBLAS_CORETYPE={}",
      core, avx512 ? "AVX-512" : "AVX2", avx512 ? "SkylakeX" : "Haswell");
}

double measure_sgemm_gflops(GemmBackend b, int n, int reps) {
  // The backend in use comes back however this returns.
  struct Restore {
    GemmBackend saved = gemm_backend();
    ~Restore() { g_backend.store(saved, std::memory_order_relaxed); }
  } restore;
  set_gemm_backend(b);
  const size_t bytes = static_cast<size_t>(n) * n * sizeof(float);
  Buffer A(bytes, MemCategory::kWorkspace), B(bytes, MemCategory::kWorkspace),
      C(bytes, MemCategory::kWorkspace);
  for (int64_t i = 0; i < int64_t{n} * n; ++i) {
    A.as<float>()[i] = static_cast<float>(i % 17) * 0.01f;
    B.as<float>()[i] = static_cast<float>(i % 13) * 0.02f;
  }
  auto run = [&] {
    gemm<float>(false, false, n, n, n, 1.0f, A.as<float>(), n, B.as<float>(), n, 0.0f,
                C.as<float>(), n);
  };
  run();
  std::vector<double> g;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    g.push_back(2.0 * double(n) * n * n / s / 1e9);
  }
  std::sort(g.begin(), g.end());
  return g[g.size() / 2];
}

#ifdef LOOM_HAVE_ONEDNN
namespace {

// One matmul primitive with its buffers: src (M, K), weights (K, N), dst (M, N).
struct Matmul {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  dnnl::memory a, b, c;
  dnnl::matmul prim;
  Matmul(int64_t M, int64_t N, int64_t K, bool bf16) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    const dt in = bf16 ? dt::bf16 : dt::f32;
    dnnl::memory::desc a_md({M, K}, in, tag::ab), b_md({K, N}, in, tag::ab),
        c_md({M, N}, dt::f32, tag::ab);
    prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), engine));
    a = dnnl::memory(a_md, engine), b = dnnl::memory(b_md, engine), c = dnnl::memory(c_md, engine);
  }
  void run() {
    prim.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
  }
};

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even (Inf stays Inf)
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace
#endif

#ifdef LOOM_HAVE_ONEDNN
namespace {
// oneDNN reports what this CPU cannot run (bf16 below AVX-512) by throwing.
std::unique_ptr<Matmul> make_matmul(int64_t M, int64_t N, int64_t K, bool bf16) {
  try {
    return std::make_unique<Matmul>(M, N, K, bf16);
  } catch (const dnnl::error& e) {
    LOOM_FAIL(kUnsupported, "oneDNN cannot run a {} matmul of {} x {} x {} on this CPU ({}): {}",
              bf16 ? "bf16" : "f32", M, N, K, gemm_backend_isa(GemmBackend::kOneDnn), e.what());
  }
}
}  // namespace
#endif

double measure_matmul_gflops(int64_t M, int64_t N, int64_t K, bool bf16, int reps) {
#ifdef LOOM_HAVE_ONEDNN
  const std::unique_ptr<Matmul> owned = make_matmul(M, N, K, bf16);
  Matmul& mm = *owned;
  const size_t esize = bf16 ? 2 : 4;
  std::memset(mm.a.get_data_handle(), 0, static_cast<size_t>(M * K) * esize);
  std::memset(mm.b.get_data_handle(), 0, static_cast<size_t>(K * N) * esize);
  mm.run();
  std::vector<double> g;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    mm.run();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    g.push_back(2.0 * double(M) * double(N) * double(K) / s / 1e9);
  }
  std::sort(g.begin(), g.end());
  return g[g.size() / 2];
#else
  (void)M, (void)N, (void)K, (void)bf16, (void)reps;
  return 0;
#endif
}

void matmul_bf16(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K) {
#ifdef LOOM_HAVE_ONEDNN
  const std::unique_ptr<Matmul> owned = make_matmul(M, N, K, true);
  Matmul& mm = *owned;
  auto* a = static_cast<uint16_t*>(mm.a.get_data_handle());
  auto* b = static_cast<uint16_t*>(mm.b.get_data_handle());
  for (int64_t i = 0; i < M * K; ++i) a[i] = to_bf16(A[i]);
  for (int64_t i = 0; i < K * N; ++i) b[i] = to_bf16(B[i]);
  mm.run();
  std::memcpy(C, mm.c.get_data_handle(), static_cast<size_t>(M * N) * sizeof(float));
#else
  (void)A, (void)B, (void)C, (void)M, (void)N, (void)K;
  LOOM_FAIL(kUnsupported, "bf16 matmul needs oneDNN, which this build lacks");
#endif
}

}  // namespace loom::cpu
