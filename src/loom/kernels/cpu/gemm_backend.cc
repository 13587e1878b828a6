#include "loom/kernels/cpu/gemm_backend.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#ifdef LOOM_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
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
  const GemmBackend saved = gemm_backend();
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
  set_gemm_backend(saved);
  std::sort(g.begin(), g.end());
  return g[g.size() / 2];
}

}  // namespace loom::cpu
