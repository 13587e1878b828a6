#include "loom/model/recompute.h"

#include "loom/core/error.h"

namespace loom {

CheckpointPolicy::Kind CheckpointPolicy::parse(const std::string& name) {
  for (Kind k : {kNone, kFull, kSelective, kEveryN, kBudget})
    if (name == CheckpointPolicy::name(k)) return k;
  LOOM_FAIL(kConfig,
            "activation_checkpointing.policy: unknown value \"{}\" (expected one of none, full, "
            "selective, every_n, budget)",
            name);
}

const char* CheckpointPolicy::name(Kind k) {
  switch (k) {
    case kNone:
      return "none";
    case kFull:
      return "full";
    case kSelective:
      return "selective";
    case kEveryN:
      return "every_n";
    case kBudget:
      return "budget";
  }
  return "?";
}

int RecomputePlan::count(Recompute r) const {
  int n = 0;
  for (Recompute b : blocks) n += b == r;
  return n;
}

std::string RecomputePlan::describe() const {
  std::string s =
      format("{} blocks: {} whole, {} selective, {} full", blocks.size(), count(Recompute::kNone),
             count(Recompute::kSelective), count(Recompute::kFull));
  if (records != DType::kF32 && count(Recompute::kFull) < static_cast<int>(blocks.size()))
    s += "; records in " + std::string(dtype_name(records));
  if (head_logits) s += "; LM-head logits recomputed";
  return s;
}

}  // namespace loom
