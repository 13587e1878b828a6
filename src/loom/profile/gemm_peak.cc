#include "loom/profile/gemm_peak.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/io/fs.h"
#include "loom/kernels/cpu/gemm_backend.h"

namespace loom {

std::vector<GemmBenchResult> bench_gemm(cpu::GemmBackend backend, const std::vector<int64_t>& sizes,
                                        int reps) {
  std::vector<GemmBenchResult> out;
  for (int64_t n : sizes) {
    size_t bytes = static_cast<size_t>(n * n) * sizeof(float);
    Buffer a(bytes, MemCategory::kWorkspace), b(bytes, MemCategory::kWorkspace),
        c(bytes, MemCategory::kWorkspace);
    for (int64_t i = 0; i < n * n; ++i) {
      a.as<float>()[i] = static_cast<float>(i % 17) * 0.01f;
      b.as<float>()[i] = static_cast<float>(i % 13) * 0.02f;
    }
    auto run = [&] {
      cpu::gemm_f32(backend, false, false, n, n, n, 1.0f, a.as<float>(), n, b.as<float>(), n, 0.0f,
                    c.as<float>(), n);
    };
    run();
    std::vector<double> gflops;
    for (int r = 0; r < reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      run();
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      gflops.push_back(2.0 * double(n) * double(n) * double(n) / s / 1e9);
    }
    std::sort(gflops.begin(), gflops.end());
    out.push_back({n, gflops[gflops.size() / 2], gflops.back()});
  }
  return out;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      return colon == std::string::npos ? line
                                        : line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown cpu";
}

std::string cpu_isa() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("flags", 0) == 0) {
      std::string isa;
      for (const char* f : {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
        if ((line + " ").find(std::string(" ") + f + " ") != std::string::npos)
          isa += (isa.empty() ? "" : " ") + std::string(f);
      return isa.empty() ? "no AVX2" : isa;
    }
  return "unknown";
}

namespace {

std::string cache_path() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::filesystem::path dir;
  if (xdg && *xdg)
    dir = std::filesystem::path(xdg) / "loom";
  else if (home && *home)
    dir = std::filesystem::path(home) / ".cache" / "loom";
  else
    return "";
  return (dir / "peak_gflops.json").string();
}

}  // namespace

const char* gemm_path_name(GemmPath p) {
  return p == GemmPath::kBf16Matmul ? "bf16 matmul" : "f32 sgemm";
}

GemmPath gemm_path_for(DType inputs) {
  return cpu::gemm_16_uses_bf16_matmul(inputs) ? GemmPath::kBf16Matmul : GemmPath::kF32Sgemm;
}

PeakGflops machine_peak_gflops(int threads, GemmPath path, bool remeasure) {
  const bool bf16 = path == GemmPath::kBf16Matmul;
  LOOM_CHECK_KIND(kUnsupported, !bf16 || cpu::gemm_16_uses_bf16_matmul(DType::kBF16),
                  "the bf16 matmul's peak needs oneDNN's bf16 matmul, which {}",
                  cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn)
                      ? "does not run on this CPU"
                      : "this build lacks");
  std::vector<cpu::GemmBackend> backends;
  std::string names;
  for (auto b : {cpu::GemmBackend::kOpenBlas, cpu::GemmBackend::kOneDnn})
    if (cpu::gemm_backend_available(b) && (!bf16 || b == cpu::GemmBackend::kOneDnn)) {
      backends.push_back(b);
      names += std::string(names.empty() ? "" : ",") + cpu::gemm_backend_name(b) + ":" +
               cpu::gemm_backend_isa(b);
    }
  // The f32 key is what earlier caches hold; the bf16 matmul's is apart.
  const std::string key =
      format("{} | {} threads | {}{}", cpu_model(), threads, names, bf16 ? " | bf16 matmul" : "");
  PeakGflops p;
  p.cache_file = cache_path();
  nlohmann::json cache = nlohmann::json::object();
  std::error_code ec;
  // A cache that cannot be read or has another shape is measured over.
  try {
    if (!p.cache_file.empty() && std::filesystem::exists(p.cache_file, ec)) {
      cache = nlohmann::json::parse(read_file(p.cache_file), nullptr, false);
      if (!cache.is_object()) cache = nlohmann::json::object();
      const nlohmann::json* e = cache.contains(key) ? &cache[key] : nullptr;
      if (e && e->is_object() && e->contains("gflops") && (*e)["gflops"].is_number() &&
          (*e)["gflops"].get<double>() > 0) {
        p.gflops = p.was = (*e)["gflops"].get<double>();
        p.backend = e->contains("backend") && (*e)["backend"].is_string()
                        ? (*e)["backend"].get<std::string>()
                        : "";
        p.cached = true;
        if (!remeasure) return p;
      }
    }
  } catch (const std::exception&) {
    cache = nlohmann::json::object();
  }
  std::string best;
  for (cpu::GemmBackend b : backends) {
    const double g = bf16 ? cpu::measure_matmul_gflops(2048, 2048, 2048, true, 5)
                          : cpu::measure_sgemm_gflops(b, 2048, 5);
    if (g > p.measured) p.measured = g, best = cpu::gemm_backend_name(b);
  }
  // The cached figure stands unless this measurement beats it.
  if (p.measured <= p.gflops) return p;
  p.gflops = p.measured, p.backend = best, p.cached = false;
  if (!p.cache_file.empty()) {
    // A failure to cache only costs the next run a measurement.
    try {
      std::filesystem::create_directories(std::filesystem::path(p.cache_file).parent_path());
      cache[key] = {{"gflops", p.gflops}, {"backend", p.backend}};
      write_file_atomic(p.cache_file, cache.dump(2) + "\n");
    } catch (const std::exception&) {
    }
  }
  return p;
}

}  // namespace loom
