// Learning-rate schedules by DeepSpeed's names and parameters.
#pragma once

#include <cstdint>
#include <string>

namespace loom {

// "" is a constant rate (the optimizer's lr).
struct SchedulerConfig {
  std::string type;  // "", WarmupLR, WarmupDecayLR, WarmupCosineLR
  double warmup_min_lr = 0.0, warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // log | linear
  int64_t total_num_steps = 0;
  double warmup_min_ratio = 0.0, cos_min_ratio = 1e-4;  // WarmupCosineLR
};

// The rate for 0-based optimizer step `step`:
//   warm-up gamma = log(step + 1) / log(W) (log) or step / W (linear), W = max(2, warmup_num_steps)
//   WarmupLR:       min + (max - min) * gamma, then max
//   WarmupDecayLR:  as WarmupLR, then max * (total - step) / (total - W) down to 0
//   WarmupCosineLR: base_lr * (min_ratio + (1 - min_ratio) gamma), then
//                   base_lr * (cos_min + (1 - cos_min) (1 + cos(pi progress)) / 2)
double learning_rate(const SchedulerConfig& s, double base_lr, int64_t step);

}  // namespace loom
