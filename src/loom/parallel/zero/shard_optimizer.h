// The optimizer state of a ZeRO shard: AdamW's moments of this rank's
// slices and, in 16-bit mode, the f32 master weights laid out like them; in
// memory, or in a memory-mapped file with offload_optimizer.device "nvme"
// (only the unit being updated is resident then).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "loom/core/memory.h"
#include "loom/optim/adamw.h"
#include "loom/parallel/zero/offload.h"
#include "loom/parallel/zero/shard_layout.h"
#include "loom/parallel/zero/zero_config.h"

namespace loom {

class ShardOptimizer {
 public:
  // rank: names the offload file.
  ShardOptimizer(const ShardLayout& shards, const ZeroConfig& config,
                 const OptimizerConfig& optimizer, const Backend<float>& backend, int rank);

  // Moments and masters, indexed like the shard.
  float* exp_avg() const { return adamw_->exp_avg(); }
  float* exp_avg_sq() const { return adamw_->exp_avg_sq(); }
  float* masters() const;  // 16-bit mode only

  // One update. f32: `params` and `grads` are what the segments' offsets
  // index (the whole layout or the shard, by stage). 16-bit mode: the
  // masters from grads16 times grad_factor, rounded into params16.
  void step(float* params, const float* grads, double lr, int64_t step);
  void step_16(uint16_t* params16, const uint16_t* grads16, float grad_factor, double lr,
               int64_t step);

  // Drops the offloaded state's pages after something touched them.
  void release() const;
  // Optimizer bytes resident in memory now (the file mapping with nvme).
  size_t resident_bytes() const;

 private:
  // Runs update(first, last) over all segments, unit by unit when offloaded.
  template <class F>
  void each_unit(F update);

  // The f32 arrays per shard element: two moments, and 16-bit mode's masters.
  int parts() const { return dtype_ != DType::kF32 ? 3 : 2; }

  const ShardLayout& shards_;
  std::unique_ptr<NvmeStore> nvme_;
  std::unique_ptr<AdamW> adamw_;
  Buffer master_;
  DType dtype_;
};

}  // namespace loom
