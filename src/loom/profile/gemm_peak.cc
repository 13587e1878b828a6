#include "loom/profile/gemm_peak.h"

#include <algorithm>
#include <chrono>

#include "loom/core/memory.h"
#include "loom/kernels/cpu/matmul.h"

namespace loom {

std::vector<GemmBenchResult> bench_gemm(const std::vector<int64_t>& sizes, int reps) {
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
      cpu::gemm<float>(false, false, n, n, n, 1.0f, a.as<float>(), n, b.as<float>(), n, 0.0f,
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

double quick_peak_gflops() {
  return bench_gemm({1024}, 9)[0].median_gflops;
}

}  // namespace loom
