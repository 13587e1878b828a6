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
// counts its updates.
//
// 0/1 Adam's local steps: the frozen steps synchronise at an interval that
// starts at 1 and doubles every local_step_scaler steps after the freeze, up
// to local_step_clipper (zero_one_local_interval); a step t synchronises
// when t is a multiple of it, or when the caller asks (the trainer does at
// every evaluation, checkpoint and the last step, so that what is evaluated
// and saved is the same on every rank). Between synchronisations no rank
// communicates: each forms its momentum from its own gradients, m_r = b1
// m_r + (1 - b1) g_r, and updates its own copy of the parameters with it,
// p_r -= lr (m_r / c1 / (sqrt(v / c2) + eps) + wd p_r); it also keeps
// a_r = sum over the interval's steps of lr m_r and L = sum of lr. At a
// synchronising step the lr-weighted mean momentum a_r / L goes through the
// 1-bit all-reduce, every rank's momentum becomes that average m, and the
// parameters the interval started from, p0, take the interval's update at
// once: p = p0 - L (m / c1 / (sqrt(v / c2) + eps) + wd p0), the same bits on
// every rank. At interval 1 that is the compressed step above, bit for bit.
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
  // Stage 0: the moments m, v are the whole layout's; stage 1: this rank's
  // shard (the momentum is then kept whole as well, as every rank's
  // compression needs it, and the step updates this rank's slices).
  OneBitAdam(const ShardLayout& shards, const ZeroConfig& zero, const OptimizerConfig& optimizer,
             const Backend<float>& backend);

  // Whether optimizer step `step` (1-based) runs compressed (its gradients
  // stay every rank's own), and whether this object updates it (0/1 Adam:
  // every step; 1-bit Adam: the compressed ones, AdamW the others).
  bool compressed(int64_t step) const;
  bool updates(int64_t step) const { return optimizer_.zero_one() || compressed(step); }
  // 0/1 Adam: whether step `step` communicates nothing (a local step that
  // does not synchronise; `sync` asks it to).
  bool local(int64_t step, bool sync) const;

  // One update over the whole layout. f32: params and the gradients (this
  // rank's when compressed, else reduced). 16-bit mode: the masters from
  // grads16 times grad_factor, rounded into params16.
  // `sync`: 0/1 Adam's local steps synchronise at this step whatever the
  // interval (ignored otherwise).
  void step(float* params, const float* grads, float* m, float* v, double lr, int64_t step,
            bool sync = false);
  void step_16(float* masters, uint16_t* params16, const uint16_t* grads16, DType t,
               float grad_factor, float* m, float* v, double lr, int64_t step, bool sync = false);

  // 0/1 Adam: synchronises an open interval now, without a new gradient
  // (the trainer's step there was skipped: a non-finite gradient), the
  // interval's update taken at `step`, the last optimizer step.
  void settle(float* params, float* m, float* v, int64_t step);
  void settle_16(float* masters, uint16_t* params16, DType t, float* m, float* v, int64_t step);
  // Whether the last step() was a local step (0/1 Adam: nothing sent).
  bool last_local() const { return last_local_; }

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
  // A step's bookkeeping of 0/1 Adam's local intervals: begin_step returns
  // whether the step synchronises an open interval; end_step closes it then.
  bool begin_step(double lr, int64_t step, bool sync);
  void end_step(bool syncs);
  void unit_step(int u, const float* g, float* params, float* m, float* v, double lr, int64_t step,
                 bool sync);
  // 0/1 Adam's local steps (interval > 1): unit u's local update, or at a
  // synchronising step its interval's update from the averaged momentum.
  void local_unit_step(int u, const float* g, float* params, float* m, const float* v, double lr,
                       int64_t step, bool sync);
  // Closes the open interval for unit u: its lr-weighted mean momentum
  // averaged, the parameters updated from the interval's start.
  void close_unit(int u, float* params, float* m, const float* v, int64_t step);
  // The 1-bit average of the segment into m: of this rank's momentum
  // b1 m + (1 - b1) g, or (acc given) of acc x inv_l.
  void compress(Segment& s, const float* g, int64_t unit_begin, float* m, const float* v,
                const float* acc = nullptr, float inv_l = 0);
  // AdamW's update of unit u's segments with the second moment as it stands
  // (frozen, or after its updates so far): p = from - lr (m / c1 / (sqrt(v /
  // c2) + eps) + wd from); p and from indexed like the moments (by_state:
  // the masters) or the layout, m like the layout, v like the moments.
  void update(int u, float* params, const float* from, bool by_state, const float* m,
              const float* v, float lr, int64_t step);
  // Stage 1: unit u's step with the whole momentum (m_full_) and this
  // rank's slices of v and of the parameters (or masters); the updated
  // momentum's slices written back into m_shard.
  void sharded_unit_step(int u, const float* g, float* params, bool masters, float* m_shard,
                         float* v_shard, double lr, int64_t step);
  // Stage 1, before a step: the whole momentum gathered from the slices
  // (once, and after a resume), and for a compressed step the mask of zero
  // variance (whenever v changed).
  void gather_state(const float* m_shard, const float* v_shard, int64_t step);
  bool sharded() const { return zero_.stage >= 1; }

  const ShardLayout& shards_;
  const ZeroConfig& zero_;
  OptimizerConfig optimizer_;
  const Backend<float>& be_;
  std::vector<Segment> segments_;
  std::vector<std::vector<size_t>> of_unit_;  // per unit: its segments
  CompressionStats stats_;
  double comm_s_ = 0;
  // 0/1 Adam's local steps: the interval's start p0 and sum of lr m, with
  // the sum of lr; whether an interval is open, and whether this step
  // opened it.
  Buffer start_, acc_;
  double lr_sum_ = 0;
  // Stage 1: every rank's whole momentum, and where the variance is zero.
  Buffer m_full_, mask_;
  bool m_ready_ = false, mask_ready_ = false;
  bool open_ = false, opens_ = false, last_local_ = false;
};

// 0/1 Adam's variance schedule: whether step t (1-based) updates the
// variance, and how many updates steps 1..t made.
bool zero_one_variance_step(int64_t t, int64_t var_freeze_step, int64_t scaler);
int64_t zero_one_variance_updates(int64_t t, int64_t var_freeze_step, int64_t scaler);
// 0/1 Adam's synchronisation interval at step t: 1 up to var_freeze_step +
// local_step_scaler, then doubled every local_step_scaler steps, at most
// local_step_clipper.
int64_t zero_one_local_interval(int64_t t, int64_t var_freeze_step, int64_t scaler,
                                int64_t clipper);

}  // namespace loom
