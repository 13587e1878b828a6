// Half-open ranges of flat-buffer elements [begin, end): shards, units,
// parameters and checkpoint pieces are all such ranges, and most of what
// ZeRO and the checkpoints do is intersect them.
#pragma once

#include <algorithm>
#include <cstdint>

namespace loom {

struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end > begin ? end - begin : 0; }
  bool empty() const { return end <= begin; }
};

// The elements in both (empty when they do not meet).
inline Range intersect(Range a, Range b) {
  return Range{std::max(a.begin, b.begin), std::min(a.end, b.end)};
}

}  // namespace loom
