// Activation checkpointing policies (config section activation_checkpointing)
// and the per-block plan a stage follows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/nn/block.h"

namespace loom {

struct CheckpointPolicy {
  enum Kind { kNone, kFull, kSelective, kEveryN, kBudget };
  Kind kind = kNone;
  int every_n = 2;           // kEveryN: blocks whose global index is a multiple of n recompute
  int64_t budget_bytes = 0;  // kBudget: activation bytes per rank
  // What the records that stay are kept in: kF32, or a 16-bit run's type
  // (activation_checkpointing.activation_dtype auto in a 16-bit run).
  DType records = DType::kF32;
  static Kind parse(const std::string& name);  // throws kConfig listing the choices
  static const char* name(Kind k);
};

// What each of a stage's blocks keeps; when any block recomputes in full,
// the LM head's logits are recomputed too (the largest single activation).
struct RecomputePlan {
  std::vector<Recompute> blocks;
  bool head_logits = false;
  // kBF16 or kF16: kNone and kSelective records are packed (block.h).
  DType records = DType::kF32;
  int count(Recompute r) const;
  std::string describe() const;  // "6 blocks: 2 whole, 0 selective, 4 full; records in bf16;
                                 // LM-head logits recomputed"
};

}  // namespace loom
