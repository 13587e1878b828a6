// How a ZeRO engine reduces gradients over the data-parallel ranks: one
// strategy interface, driven by the unit hooks as backward goes.
//
//   BucketedAllReduce (stages 0-1)  full gradients on every rank; in the
//       step's last micro-batch, contiguous buckets of the flat gradients
//       (formed in reverse parameter order, the order backward finishes
//       them) are averaged by asynchronous all-reduces as soon as backward
//       has produced their last gradient, so communication overlaps the rest
//       of backward.
//   UnitReduceScatter (stages 2-3)  backward writes each unit's gradients
//       into a unit-sized buffer, reduce-scattered into the shard's
//       gradients as soon as backward is done with the unit (every
//       micro-batch), with at most reduce_bucket_size elements in flight.
//
// A reducer keeps its per-bucket (or per-unit) state and sees the layout's
// parameters and their shapes (ShardLayout::layout()), so one that
// compresses matrices fits behind the same calls.
//
// 16-bit mode: backward writes a unit's gradients into an f32 buffer that
// the reducer owns while the unit is written; once backward is done with
// the unit they are added into the 16-bit gradients (stages 0-1, all-reduced
// in 16 bits later) or rounded and reduce-scattered in 16 bits (stages 2-3;
// the collective accumulates in f32).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/nn/param_store.h"
#include "loom/parallel/zero/comm_wait.h"
#include "loom/parallel/zero/shard_layout.h"
#include "loom/parallel/zero/zero_config.h"

namespace loom {

// Where the reduced gradients are kept: the whole layout below stage 2,
// this rank's shard from stage 2; f32, or 16-bit in 16-bit mode.
struct GradTarget {
  float* f32 = nullptr;
  uint16_t* h16 = nullptr;
};

class GradReducer {
 public:
  virtual ~GradReducer() = default;
  // A micro-batch begins; `reduce`: the gradients its backward writes are
  // reduced in it (the step's last micro-batch at stages 0-1, every one at
  // stages 2-3); `last`: it is the step's last.
  virtual void begin(bool reduce, bool last) = 0;
  // Backward is about to write unit u's gradients: binds where the layers
  // write them (a no-op while they are bound).
  virtual void acquire(int u) = 0;
  // Backward is done writing unit u's gradients for now (its next use, if
  // any, does not write them).
  virtual void written(int u) = 0;
  // No later use in this micro-batch writes unit u's gradients.
  virtual void final(int u) = 0;
  // The micro-batch ends: waits for its reductions and leaves the reduced
  // gradients in the target.
  virtual void end() = 0;
  // Communication since the last call.
  CommStats take_stats() {
    CommStats s = stats_;
    stats_ = CommStats{};
    return s;
  }
  // What compression did since the last call (compression.h).
  CompressionStats take_compression() {
    CompressionStats s = cstats_;
    cstats_.sent_bytes = cstats_.plain_bytes = 0;
    return s;
  }

  // The state a compressing reducer carries from step to step
  // (compression.h), for checkpoints. steps(): reductions done so far
  // (start_iter counts them).
  virtual std::vector<CompressionState> state() { return {}; }
  int64_t steps() const { return steps_; }
  void set_steps(int64_t n) { steps_ = n; }

 protected:
  CommStats stats_;
  CompressionStats cstats_;
  int64_t steps_ = 0;
};

// The stage's reducer (stages 0-1: bucketed all-reduce; 2-3: per-unit
// reduce-scatter) over `store`'s units as `shards` splits them.
std::unique_ptr<GradReducer> make_grad_reducer(ParamStore<float>& store, const ShardLayout& shards,
                                               const ZeroConfig& config, GradTarget target);

}  // namespace loom
