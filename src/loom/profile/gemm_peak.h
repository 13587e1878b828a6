// Peak sgemm throughput of this machine: the denominator of MFU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/kernels/cpu/gemm_backend.h"

namespace loom {

struct GemmBenchResult {
  int64_t n = 0;             // square size n x n x n
  double median_gflops = 0;  // over the repetitions
  double best_gflops = 0;
};

// Times `reps` sgemm calls of GEMM backend b at each size after one warm-up call.
std::vector<GemmBenchResult> bench_gemm(cpu::GemmBackend b, const std::vector<int64_t>& sizes,
                                        int reps);

// The MFU denominator when log.peak_gflops is not set: the best large sgemm
// this machine reaches with any GEMM backend loom links (never a misdetected
// kernel's figure alone): the median of five 2048^3 calls per backend
// (about 1 s), measured once and cached per machine in
// $XDG_CACHE_HOME/loom/peak_gflops.json (else ~/.cache/loom/), keyed by the
// CPU model, the thread count and the backends; the GEMM backend in use is
// restored after measuring.
struct PeakGflops {
  double gflops = 0;
  std::string backend;  // the backend that reached it
  bool cached = false;  // read from the cache file
  std::string cache_file;
};
PeakGflops machine_peak_gflops(int threads);

}  // namespace loom
