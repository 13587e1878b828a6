// Dynamic loss scaling for fp16 training, with DeepSpeed's rules and keys:
// the loss is multiplied by the scale before backward, so small gradients
// survive fp16; a step whose gradients overflow (any inf or NaN, agreed over
// every rank) is skipped and, once `hysteresis` overflows have used up the
// tolerance, halves the scale (never below `min_loss_scale`); every
// `loss_scale_window` steps without an overflow double it. A static scale
// (`loss_scale` > 0) never changes.
#pragma once

#include <cstdint>

namespace loom {

struct LossScaleConfig {
  double loss_scale = 0;         // 0: dynamic; > 0: this static scale
  int initial_scale_power = 16;  // dynamic: start at 2^this
  int64_t loss_scale_window = 1000;
  int hysteresis = 2;                   // overflows tolerated before the scale drops
  bool consecutive_hysteresis = false;  // refill the tolerance after every clean step
  double min_loss_scale = 1;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScaleConfig& c);
  double scale() const { return scale_; }
  // After a step: whether its gradients overflowed. Returns false when the
  // scale was already at min_loss_scale and the step overflowed again (the
  // caller stops: no smaller scale is allowed).
  bool update(bool overflow);
  // Steps seen, and the last one that overflowed (-1: none), for checkpoints.
  int64_t iteration() const { return iter_; }
  int hysteresis_left() const { return hysteresis_left_; }
  int64_t last_overflow() const { return last_overflow_; }
  void restore(double scale, int64_t iteration, int64_t last_overflow, int hysteresis_left);

 private:
  LossScaleConfig c_;
  double scale_;
  int64_t iter_ = 0;
  int64_t last_overflow_ = -1;
  int hysteresis_left_;
};

}  // namespace loom
