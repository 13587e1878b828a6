#include "loom/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace loom {

double learning_rate(const SchedulerConfig& s, double base_lr, int64_t step) {
  if (s.type.empty()) return base_lr;
  const int64_t warm = std::max<int64_t>(2, s.warmup_num_steps);
  double gamma = 1.0;
  if (step < warm) {
    gamma = s.warmup_type == "log" ? std::log(double(step + 1)) / std::log(double(warm))
                                   : double(step) / double(warm);
  }
  if (s.type == "WarmupLR") return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
  if (s.type == "WarmupDecayLR") {
    if (step >= warm)
      gamma = std::max(0.0, double(s.total_num_steps - step) / double(s.total_num_steps - warm));
    return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
  }
  // WarmupCosineLR scales the optimizer's own rate.
  if (step < warm) return base_lr * (s.warmup_min_ratio + (1 - s.warmup_min_ratio) * gamma);
  double progress = std::min(1.0, double(step - warm) / double(s.total_num_steps - warm));
  double ratio = (1 + std::cos(M_PI * progress)) / 2;
  return base_lr * std::max(0.0, s.cos_min_ratio + (1 - s.cos_min_ratio) * ratio);
}

}  // namespace loom
