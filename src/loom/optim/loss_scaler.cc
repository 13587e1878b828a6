#include "loom/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>

namespace loom {

LossScaler::LossScaler(const LossScaleConfig& c)
    : c_(c),
      scale_(c.loss_scale > 0 ? c.loss_scale : std::ldexp(1.0, c.initial_scale_power)),
      hysteresis_left_(c.hysteresis) {}

bool LossScaler::update(bool overflow) {
  bool ok = true;
  if (c_.loss_scale > 0) {
    ++iter_;
    return true;  // static: skipping is all an overflow does
  }
  if (overflow) {
    if (hysteresis_left_ <= 1) {
      // The tolerance is used up: halve, down to the floor; an overflow at
      // the floor cannot be answered by a smaller scale.
      ok = scale_ > c_.min_loss_scale;
      scale_ = std::max(scale_ / 2, c_.min_loss_scale);
    } else {
      --hysteresis_left_;
    }
    last_overflow_ = iter_;
  } else {
    if (c_.consecutive_hysteresis) hysteresis_left_ = c_.hysteresis;
    // A full window since the last overflow (or since the start) doubles it.
    if ((iter_ - last_overflow_) % c_.loss_scale_window == 0) {
      if (!c_.consecutive_hysteresis) hysteresis_left_ = c_.hysteresis;
      scale_ *= 2;
    }
  }
  ++iter_;
  return ok;
}

void LossScaler::restore(double scale, int64_t iteration, int64_t last_overflow,
                         int hysteresis_left) {
  scale_ = scale;
  iter_ = iteration;
  last_overflow_ = last_overflow;
  hysteresis_left_ = hysteresis_left;
}

}  // namespace loom
