// 1-bit Adam (optimizer.type OneBitAdam): AdamW for the first freeze_step
// optimizer steps, with the plain gradient reduction; from then on the
// second moment is frozen and the gradients are not reduced: every rank
// forms its momentum from its own gradient, m_r = b1 m + (1 - b1) g_r, and
// the 1-bit compressed all-reduce (comm/compressed.h) averages the m_r into
// the momentum every rank continues with, the same bits everywhere. Each
// rank then updates all parameters alike:
//   p -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^f)) + eps) + wd p)
// with f = freeze_step (AdamW's update with v frozen, and its bias
// correction with it).
//
// Each unit is compressed on its own (its scale, its signs), so a tied
// parameter held by two pipeline stages compresses alike on both. Elements
// whose second moment is zero at the freeze (gradients that were always
// zero, alignment padding) are masked: their momentum and errors stay zero,
// so they are never moved by compression noise divided by sqrt(0) + eps.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/comm/compressed.h"
#include "loom/kernels/backend.h"
#include "loom/optim/adamw.h"
#include "loom/parallel/zero/compression.h"
#include "loom/parallel/zero/shard_layout.h"
#include "loom/parallel/zero/zero_config.h"

namespace loom {

class OneBitAdam {
 public:
  // Stage 0 only: the moments m, v are the whole layout's.
  OneBitAdam(const ShardLayout& shards, const ZeroConfig& zero, const OptimizerConfig& optimizer,
             const Backend<float>& backend);

  // Whether optimizer step `step` (1-based) runs compressed.
  bool compressed(int64_t step) const { return step > optimizer_.freeze_step; }

  // One compressed step over the whole layout. f32: params and this rank's
  // gradients. 16-bit mode: the masters from grads16 times grad_factor,
  // rounded into params16.
  void step(float* params, const float* grads, float* m, const float* v, double lr, int64_t step);
  void step_16(float* masters, uint16_t* params16, const uint16_t* grads16, DType t,
               float grad_factor, float* m, const float* v, double lr, int64_t step);

  // The worker and server errors, per parameter, for checkpoints.
  std::vector<CompressionState> state();
  CompressionStats take_stats() {
    CompressionStats s = stats_;
    stats_.sent_bytes = stats_.plain_bytes = 0;
    return s;
  }

 private:
  // The momentum of unit u from its gradients g (f32), compressed and
  // averaged into m; the mask applied; then the update of its elements
  // (params indexed like m).
  void unit_step(int u, const float* g, float* params, float* m, const float* v, double lr,
                 int64_t step);

  const ShardLayout& shards_;
  const ZeroConfig& zero_;
  OptimizerConfig optimizer_;
  const Backend<float>& be_;
  std::vector<std::unique_ptr<CompressedAllReduce>> units_;  // null: reduced over no group
  CompressionStats stats_;
};

}  // namespace loom
