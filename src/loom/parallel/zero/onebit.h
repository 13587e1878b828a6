// The 1-bit optimizers.
//
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
// 0/1 Adam (ZeroOneAdam): the variance is updated only at exponentially
// spaced steps up to var_freeze_step (every step for the first
// var_update_scaler updates, then every 2nd for as many, every 4th, ...);
// at those steps the gradients are reduced uncompressed and m and v take
// AdamW's update; at every other step the momentum is averaged by the
// 1-bit compressed all-reduce as above, with v kept. After var_freeze_step
// v is frozen and every step is compressed. The bias correction of v
// counts its updates. (0/1 Adam's local steps, which begin
// local_step_scaler steps after the freeze, are refused by the config.)
//
// Each matrix is compressed on its own (its scale, its signs), and each
// unit's other parameters together, so a tied matrix held by two pipeline
// stages (wte) compresses alike on both and its copies stay equal. Elements
// whose second moment is zero at the freeze (gradients that were always
// zero, alignment padding) are masked: their momentum and errors stay zero,
// so they are never moved by compression noise divided by sqrt(0) + eps.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
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

  // Whether optimizer step `step` (1-based) runs compressed (its gradients
  // stay every rank's own), and whether this object updates it (0/1 Adam:
  // every step; 1-bit Adam: the compressed ones, AdamW the others).
  bool compressed(int64_t step) const;
  bool updates(int64_t step) const { return optimizer_.zero_one() || compressed(step); }

  // One update over the whole layout. f32: params and the gradients (this
  // rank's when compressed, else reduced). 16-bit mode: the masters from
  // grads16 times grad_factor, rounded into params16.
  void step(float* params, const float* grads, float* m, float* v, double lr, int64_t step);
  void step_16(float* masters, uint16_t* params16, const uint16_t* grads16, DType t,
               float grad_factor, float* m, float* v, double lr, int64_t step);

  // The worker and server errors, per parameter, for checkpoints.
  std::vector<CompressionState> state();
  CompressionStats take_stats() {
    CompressionStats s = stats_;
    stats_.sent_bytes = stats_.plain_bytes = 0;
    return s;
  }
  // Seconds the step waited for its compressed all-reduces since the last
  // call (they block the update: all of it exposed).
  double take_comm_seconds() {
    const double s = comm_s_;
    comm_s_ = 0;
    return s;
  }

 private:
  // What one compressed all-reduce covers: a matrix, or a unit's other
  // parameters gathered into one vector (their flat ranges, in order).
  struct Segment {
    int unit;
    std::vector<std::pair<int64_t, int64_t>> ranges;  // flat [begin, end)
    int64_t size = 0;
    std::unique_ptr<CompressedAllReduce> ca;  // null: reduced over no group
  };

  // Unit u's update from its gradients g (f32, the unit's): compressed, the
  // momentum of g averaged into m with the mask applied, segment by
  // segment; else (0/1 Adam's variance steps) m and v updated from the
  // reduced g. Then the parameters (indexed like m).
  void unit_step(int u, const float* g, float* params, float* m, float* v, double lr, int64_t step);
  void compress(Segment& s, const float* g, int64_t unit_begin, float* m, const float* v);

  const ShardLayout& shards_;
  const ZeroConfig& zero_;
  OptimizerConfig optimizer_;
  const Backend<float>& be_;
  std::vector<Segment> segments_;
  std::vector<std::vector<size_t>> of_unit_;  // per unit: its segments
  CompressionStats stats_;
  double comm_s_ = 0;
};

// 0/1 Adam's variance schedule: whether step t (1-based) updates the
// variance, and how many updates steps 1..t made.
bool zero_one_variance_step(int64_t t, int64_t var_freeze_step, int64_t scaler);
int64_t zero_one_variance_updates(int64_t t, int64_t var_freeze_step, int64_t scaler);

}  // namespace loom
