// DeepSpeed's zero_optimization section, as loom reads it.
#pragma once

#include <cstdint>
#include <string>

#include "loom/core/dtype.h"
#include "loom/parallel/zero/compression.h"

namespace loom {

struct ZeroConfig {
  // 0: replicated; 1: optimizer state sharded; 2: also gradients; 3: also parameters.
  int stage = 0;
  // Elements, as DeepSpeed counts. Stages 0-1: the size of a gradient
  // all-reduce bucket. Stages 2-3: the most gradient elements being reduced
  // at once (the latest unit's reduction may always run). loom's default (1e6) is smaller than
  // DeepSpeed's 5e8 so that models of a few million parameters still overlap several reductions
  // with backward.
  int64_t reduce_bucket_size = 1000000;
  bool overlap_comm = true;
  // Stage 3: parameter elements gathered ahead of use (at least the next
  // unit when > 0; 0 gathers on use only).
  int64_t prefetch_bucket_size = 1000000;
  // Stage 3: units with at most this many elements stay gathered between uses.
  int64_t persistence_threshold = 100000;
  // offload_optimizer: "none", "cpu" (the same as none on a CPU build) or
  // "nvme" (moments in memory-mapped files under nvme_path).
  std::string offload_device = "none";
  std::string nvme_path;
  // Not a zero_optimization key: bf16.enabled / fp16.enabled. kBF16 or
  // kF16 keeps parameters and gradients in 16 bits and f32 master weights
  // beside the moments (the engine's 16-bit mode, zero.h).
  DType dtype = DType::kF32;
  // 16-bit mode with 16-bit GEMM inputs (kernels.gemm_inputs: 16bit): the
  // layers read a unit's matrices in 16 bits where the engine holds them,
  // and only its other parameters are widened to f32 while it is in use.
  bool weights16 = false;
  // Not a zero_optimization key: comm.compression (compression.h).
  CompressionConfig compression;
  bool pin_memory = false;   // accepted; no effect on a CPU build
  int64_t buffer_count = 4;  // accepted; no effect (moments are paged unit by unit)
};

}  // namespace loom
