// The rank grid: a pure function from the world size and the tensor,
// context, pipeline and expert sizes to every rank's coordinates and group
// members, in Megatron-LM's order (tp varies fastest, then cp, then dp, then
// pp; expert groups are carved out of the dp x cp ranks). No processes are
// involved, so it is unit-tested alone.
//
// The ranks of one dp x cp group hold the same parameters: they reduce
// gradients and shard ZeRO state together (dp_cp_group); the cp ranks of a
// replica share its samples, each holding part of every sequence.
#pragma once

#include <string>
#include <vector>

namespace loom {

struct GridShape {
  int world = 1;
  int tp = 1;  // tensor parallel
  int pp = 1;  // pipeline parallel
  int ep = 1;  // expert parallel, a divisor of dp x cp
  int cp = 1;  // context parallel: the sequence split over cp ranks
  int dp() const { return world / (tp * cp * pp); }
};

struct GridCoord {
  int tp = 0, cp = 0, dp = 0, pp = 0;
  int ep = 0;     // index inside the expert-parallel group
  int ep_dp = 0;  // index inside the expert-data-parallel group
  int dp_cp(int cp_size) const { return cp + cp_size * dp; }  // index in the dp x cp group
};

class Grid {
 public:
  // Throws Error(kConfig) when the shape is invalid, with the numbers and the
  // nearest valid choices.
  explicit Grid(GridShape shape);

  const GridShape& shape() const { return shape_; }
  int rank_of(int tp, int dp, int pp, int cp = 0) const {
    return tp + shape_.tp * (cp + shape_.cp * (dp + shape_.dp() * pp));
  }
  GridCoord coord(int rank) const;

  // Members (global ranks, ascending) of the groups that contain `rank`.
  std::vector<int> tp_group(int rank) const;
  std::vector<int> cp_group(int rank) const;
  std::vector<int> dp_group(int rank) const;     // same tp, cp, pp
  std::vector<int> dp_cp_group(int rank) const;  // same tp, pp: the ranks of one parameter shard
  std::vector<int> pp_group(int rank) const;
  std::vector<int> model_parallel_group(int rank) const;  // same dp, cp: tp x pp ranks
  std::vector<int> embedding_group(int rank) const;       // first and last stage of the pp group
  std::vector<int> ep_group(int rank) const;              // ep consecutive dp x cp ranks
  std::vector<int> ep_dp_group(int rank) const;           // dp x cp ranks holding the same experts

  // All groups of one kind, each once, for creating communicators in the same
  // order on every rank. kind: "tp", "cp", "dp", "dp_cp", "pp", "mp", "embedding", "ep", "ep_dp".
  std::vector<std::vector<int>> all_groups(const std::string& kind) const;

  std::string describe()
      const;  // "world 8 = tp 2 x dp 2 x pp 2 (ep 2)", "tp 2 x cp 2 x ..." with cp

 private:
  GridShape shape_;
};

}  // namespace loom
