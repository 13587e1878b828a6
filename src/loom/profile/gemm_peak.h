// Peak sgemm throughput of this machine: the denominator of MFU.
#pragma once

#include <cstdint>
#include <vector>

namespace loom {

struct GemmBenchResult {
  int64_t n = 0;             // square size n x n x n
  double median_gflops = 0;  // over the repetitions
  double best_gflops = 0;
};

// Times `reps` sgemm calls at each size after one warm-up call.
std::vector<GemmBenchResult> bench_gemm(const std::vector<int64_t>& sizes, int reps);

// A short measurement (about 0.6 s) for MFU when no figure is configured:
// the median of five 2048^3 sgemm calls (smaller sizes run well below peak
// with several threads).
double quick_peak_gflops();

}  // namespace loom
