#include "loom/parallel/zero/shard_layout.h"

#include "loom/core/error.h"

namespace loom {

ShardLayout::ShardLayout(const ParamLayout& layout, int stage, std::shared_ptr<ProcessGroup> dp,
                         const ExpertGroups& experts)
    : layout_(&layout), units_(layout.units()) {
  auto unit_group = [&](std::shared_ptr<ProcessGroup> g, float scale) {
    UnitGroup x;
    x.group = std::move(g);
    if (x.group) x.rank = x.group->rank(), x.size = x.group->size();
    if (stage >= 1) x.srank = x.rank, x.shards = x.size;
    x.scale = scale;
    return x;
  };
  groups_.push_back(unit_group(std::move(dp), 1.0f));
  const int ep = experts.ep_size();
  LOOM_CHECK(groups_[0].size % ep == 0,
             "an expert-parallel group of {} in a data-parallel group of {}", ep, groups_[0].size);
  groups_.push_back(ep > 1 ? unit_group(experts.ep_dp, 1.0f / static_cast<float>(ep)) : groups_[0]);

  used_with_.resize(units_.size());
  for (int u = 0; u < num_units(); ++u) {
    unit_group_.push_back(unit(u).expert() ? 1 : 0);
    used_with_[static_cast<size_t>(u)].push_back(u);
    if (unit(u).expert()) used_with_[static_cast<size_t>(unit(u).host)].push_back(u);
  }
  for (int u = 0; u < num_units(); ++u) {
    LOOM_CHECK(unit(u).size() % group(u).shards == 0,
               "unit {} of {} elements does not split into {}", unit(u).name, unit(u).size(),
               group(u).shards);
    slice_.push_back(unit(u).size() / group(u).shards);
    shard_off_.push_back(shard_elements_);
    const int64_t b = slice_begin(u);
    const size_t first = segments_.size();
    for (AdamWSegment s : adamw_segments(layout, b, b + slice(u))) {
      const int64_t in_shard = shard_elements_ + (s.param_offset - b);
      s.state_offset = in_shard;
      if (stage >= 2) s.grad_offset = in_shard;
      if (stage >= 3) s.param_offset = in_shard;
      segments_.push_back(s);
    }
    unit_segments_.push_back({first, segments_.size()});
    shard_elements_ += slice(u);
  }
}

}  // namespace loom
