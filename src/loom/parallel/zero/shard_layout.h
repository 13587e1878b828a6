// How a ZeRO engine's model part splits over its ranks.
//
// Sharding is by unit (ParamLayout): every unit's flat range splits into one
// equal slice per rank of the group it is reduced over (the data-parallel
// group; for expert units under expert parallelism, the ranks holding the
// same experts), and a rank's shard is its slices of all units, kept
// contiguous. So a unit's full parameters are one all-gather of the ranks'
// slices, and its gradients one reduce-scatter into them. Below stage 1
// nothing is sharded: a rank's "slice" of a unit is all of it.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/nn/param.h"
#include "loom/optim/adamw.h"

namespace loom {

// Expert parallelism (parallel.expert > 1): the expert units (Unit::expert)
// hold this rank's experts, which the ranks of the expert-parallel group
// `ep` split between them; `ep_dp` (null: this rank alone) is the
// data-parallel ranks holding the same experts. Expert gradients are
// averaged over ep_dp and divided by ep (so they carry every data-parallel
// rank's tokens at 1 / dp, as dense gradients do), their ZeRO shards split
// over ep_dp, and gradient norms add the ep ranks' experts.
struct ExpertGroups {
  std::shared_ptr<ProcessGroup> ep, ep_dp;
  int ep_size() const { return ep ? ep->size() : 1; }
};

// The group a unit's gradients are reduced over and its shards split
// across: the data-parallel group for dense units, ep_dp for expert units
// under expert parallelism.
struct UnitGroup {
  std::shared_ptr<ProcessGroup> group;  // null: this rank alone
  int rank = 0, size = 1;
  int srank = 0, shards = 1;  // rank and count of shards (1 when unsharded)
  float scale = 1;            // applied to the group's average (expert units: 1 / ep)
};

class ShardLayout {
 public:
  // dp: the data-parallel group (null: one process). Stages >= 1 shard.
  ShardLayout(const ParamLayout& layout, int stage, std::shared_ptr<ProcessGroup> dp,
              const ExpertGroups& experts);

  const ParamLayout& layout() const { return *layout_; }
  int num_units() const { return static_cast<int>(units_.size()); }
  const Unit& unit(int u) const { return units_[static_cast<size_t>(u)]; }
  const UnitGroup& group(int u) const {
    return groups_[static_cast<size_t>(unit_group_[static_cast<size_t>(u)])];
  }
  // The dense units' group (the data-parallel one).
  const UnitGroup& dense() const { return groups_[0]; }
  // This rank's slice of unit u: its length, where it starts in the shard
  // and in the flat layout.
  int64_t slice(int u) const { return slice_[static_cast<size_t>(u)]; }
  int64_t shard_offset(int u) const { return shard_off_[static_cast<size_t>(u)]; }
  int64_t slice_begin(int u) const { return unit(u).begin + group(u).srank * slice(u); }
  // Elements of this rank's shard (the whole layout when unsharded).
  int64_t shard_elements() const { return shard_elements_; }
  // A use of unit u is a use of u and of the expert units riding on it.
  const std::vector<int>& used_with(int u) const { return used_with_[static_cast<size_t>(u)]; }
  // The optimizer's segments over the shard (moments at shard offsets;
  // gradients too from stage 2, parameters too at stage 3), and each unit's
  // range [first, last) of them.
  const std::vector<AdamWSegment>& segments() const { return segments_; }
  std::pair<size_t, size_t> unit_segments(int u) const {
    return unit_segments_[static_cast<size_t>(u)];
  }

 private:
  const ParamLayout* layout_;
  std::vector<Unit> units_;
  std::vector<UnitGroup> groups_;  // [0] dense, [1] expert units
  std::vector<int> unit_group_;    // per unit: its groups_ entry
  std::vector<std::vector<int>> used_with_;
  std::vector<int64_t> slice_, shard_off_;
  std::vector<AdamWSegment> segments_;
  std::vector<std::pair<size_t, size_t>> unit_segments_;
  int64_t shard_elements_ = 0;
};

}  // namespace loom
