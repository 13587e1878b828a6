// loom plan --calibrate: this host as the planner's cluster file sees a
// device (one rank with its threads): its GEMM peak in each precision, the
// GEMM efficiency curve fitted to sgemms of the given shapes, its memory
// bandwidth and its share of the host's memory. The links come from the
// ranks of the job (apps/loom/plan.cc).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace loom {

struct GemmPoint {
  int64_t m = 0, n = 0, k = 0;
  double gflop = 0, gflops = 0;  // the call's size, and the rate it ran at
};

struct HostCalibration {
  double peak_gflops_32 = 0, peak_gflops_16 = 0;  // per rank
  double gemm_max = 0, gemm_half_gflop = 0;       // rate = peak x max x F / (F + half)
  double memory_bandwidth_gbps = 0;               // a large copy, read + write
  double memory_bytes = 0;                        // the host's, per rank on it
  std::vector<GemmPoint> points;
};

// The sgemm shapes a model's blocks and head run at, micro-batch 1 (M x N x
// K: the attention's projections, the MLP's two, the LM head), and a sweep
// of squares from 128 to 2048.
std::vector<std::array<int64_t, 3>> calibration_shapes(int64_t seq, int64_t hidden, int64_t vocab);

// Measures (a few seconds); ranks_on_host divides the host's memory.
HostCalibration calibrate_host(int threads, int ranks_on_host,
                               const std::vector<std::array<int64_t, 3>>& shapes);

// Least squares of 1/eff = 1/max + (half/max) / F over the points (eff =
// rate / peak): {max (at most 1), half}.
std::array<double, 2> fit_gemm_efficiency(const std::vector<GemmPoint>& points, double peak);

}  // namespace loom
