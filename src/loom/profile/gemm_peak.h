// Peak GEMM throughput of this machine on the path a run's products take:
// the denominator of MFU.
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
// restored after measuring. A peak is the best the machine has shown: with
// `remeasure` it is measured again even when cached, and the cache keeps the
// higher of the two (a first measurement taken on a busy machine would
// otherwise stay low for good and inflate every MFU after it); `loom bench`
// remeasures, `loom train` reads the cache.
struct PeakGflops {
  double gflops = 0;
  std::string backend;  // the backend that reached it
  bool cached = false;  // the figure is the cache file's (remeasured or not)
  double measured = 0;  // this call's measurement (0: none)
  double was = 0;       // the cached figure before it (0: none)
  std::string cache_file;
};

// The path a run's GEMMs take, which decides its peak: the f32 sgemm (f32
// inputs, and fp16 inputs, rounded K-tiles through the sgemm), or oneDNN's
// bf16 matmul (bf16 inputs where it runs), whose peak is its own: 4-7x the
// sgemm's on CPUs with AMX, about 2x on AMD's AVX512-BF16, no more than it on
// Intel's AVX512-BF16 without AMX.
enum class GemmPath { kF32Sgemm, kBf16Matmul };
const char* gemm_path_name(GemmPath p);
// /proc/cpuinfo's model name, and which of avx2, avx512f, avx512_bf16 and
// amx_bf16 the CPU has.
std::string cpu_model();
std::string cpu_isa();  // "f32 sgemm", "bf16 matmul"
// The path of a run whose GEMM inputs are `inputs` (kernels.gemm_inputs).
GemmPath gemm_path_for(DType inputs);

// path kBf16Matmul: the median of five 2048^3 bf16 matmuls (f32
// accumulation), cached under its own key.
PeakGflops machine_peak_gflops(int threads, GemmPath path = GemmPath::kF32Sgemm,
                               bool remeasure = false);

}  // namespace loom
