#include "loom/profile/calibrate.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/profile/gemm_peak.h"

namespace loom {

std::vector<std::array<int64_t, 3>> calibration_shapes(int64_t seq, int64_t hidden, int64_t vocab) {
  std::vector<std::array<int64_t, 3>> s;
  if (seq > 0 && hidden > 0) {
    s.push_back({seq, 3 * hidden, hidden});  // attention's qkv
    s.push_back({seq, hidden, hidden});      // its output projection
    s.push_back({seq, 4 * hidden, hidden});  // the MLP's first
    s.push_back({seq, hidden, 4 * hidden});  // and second
    if (vocab > 0) s.push_back({seq, vocab, hidden});
  }
  for (int64_t n = 128; n <= 2048; n *= 2) s.push_back({n, n, n});
  return s;
}

std::array<double, 2> fit_gemm_efficiency(const std::vector<GemmPoint>& points, double peak) {
  LOOM_CHECK(points.size() >= 2 && peak > 0, "fit_gemm_efficiency: {} points, peak {}",
             points.size(), peak);
  // y = a + b x with y = 1/eff, x = 1/F.
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const GemmPoint& p : points) {
    const double x = 1 / p.gflop, y = peak / std::max(1e-9, p.gflops);
    sx += x, sy += y, sxx += x * x, sxy += x * y;
  }
  const double n = double(points.size());
  const double den = n * sxx - sx * sx;
  double b = den != 0 ? (n * sxy - sx * sy) / den : 0;
  double a = (sy - b * sx) / n;
  if (a < 1) a = 1;  // no faster than the peak
  // Small GEMMs no slower than large ones: the curve is flat (a
  // thousandth of a GFLOP is where it halves).
  return {1 / a, std::max(1e-3, b / a)};
}

HostCalibration calibrate_host(int threads, int ranks_on_host,
                               const std::vector<std::array<int64_t, 3>>& shapes) {
  HostCalibration h;
  h.peak_gflops_32 = machine_peak_gflops(threads).gflops;
  // A bf16 run's GEMMs take oneDNN's bf16 matmul where kernels.gemm_inputs
  // auto picks it (cpu::bf16_matmul_pays); else the f32 sgemm.
  const bool bf16 = cpu::bf16_matmul_pays_here();
  h.peak_gflops_16 =
      bf16 ? std::max(h.peak_gflops_32, machine_peak_gflops(threads, GemmPath::kBf16Matmul).gflops)
           : h.peak_gflops_32;
  for (const auto& [m, n, k] : shapes) {
    GemmPoint p{m, n, k, 2.0 * double(m) * double(n) * double(k) / 1e9, 0};
    p.gflops = cpu::measure_matmul_gflops(m, n, k, false, 3);
    h.points.push_back(p);
  }
  const auto [mx, half] = fit_gemm_efficiency(h.points, h.peak_gflops_32);
  h.gemm_max = mx, h.gemm_half_gflop = half;
  // Memory bandwidth: the median of five copies of 256 MB (read + write).
  const size_t bytes = size_t{256} << 20;
  Buffer a(bytes, MemCategory::kWorkspace), b(bytes, MemCategory::kWorkspace);
  std::vector<double> rates;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(2.0 * double(bytes) / s / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  h.memory_bandwidth_gbps = rates[2];
  const double pages = double(sysconf(_SC_PHYS_PAGES)), page = double(sysconf(_SC_PAGESIZE));
  h.memory_bytes = pages * page / std::max(1, ranks_on_host);
  return h;
}

}  // namespace loom
