// The rank grid and every process group it hands out, built once and passed
// explicitly to whatever communicates (DESIGN.md: nothing global). A group of
// one rank is null: no communication happens over it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "loom/comm/grid.h"
#include "loom/comm/process_group.h"
#include "loom/comm/topology.h"

namespace loom {

struct ParallelContext {
  Grid grid{GridShape{}};
  int rank = 0;         // grid rank: the rank in `world`
  int launch_rank = 0;  // the rank the launcher gave this process
  // The world in grid order (grid rank g is launch rank order[g]); the hosts
  // of the launch ranks; what the placement did, and the groups it could
  // not keep inside a host, for the log.
  std::shared_ptr<ProcessGroup> world;
  std::shared_ptr<ProcessGroup> launch_world;  // the world in launch order, kept with the context
  std::vector<int> order{0};
  Topology topology = single_host(1);
  std::string placement;
  std::vector<std::string> warnings;
  // dp: the ranks that hold the same parameters (the dp x cp ranks of the
  // grid): they reduce gradients, shard ZeRO state and average losses.
  // cp: the ranks that share a replica's sequences, each holding two of
  // their 2 x cp chunks.
  std::shared_ptr<ProcessGroup> dp, cp, tp, pp, ep, ep_dp;
  std::shared_ptr<ProcessGroup> embedding;       // first and last pipeline stage
  std::shared_ptr<ProcessGroup> model_parallel;  // tp x pp ranks of one replica

  GridCoord coord() const { return grid.coord(rank); }
  int dp_rank() const { return dp ? dp->rank() : 0; }
  int dp_size() const { return dp ? dp->size() : 1; }
  int cp_rank() const { return cp ? cp->rank() : 0; }
  int cp_size() const { return cp ? cp->size() : 1; }
  // The data-parallel replica this rank's samples are drawn for, and how
  // many replicas there are (the batch identity's dp).
  int replica() const { return coord().dp; }
  int replicas() const { return grid.shape().dp(); }
  // Rank 0 of the world writes the run folder, metrics and checkpoints.
  bool writer() const { return rank == 0; }
};

// The context of `world` (null: one process) laid out as `shape`. Collective
// over `world` when a group must be split off (every rank calls it with the
// same shape); a group of the whole world reuses `world`, except the
// expert-parallel group, which always gets a communicator of its own.
// With comm.placement "topology" (the default) the ranks are placed on the
// grid host by host (topology_order), so tensor- and expert-parallel groups
// stay inside a host; "launcher" keeps the launcher's order. Throws
// Error(kConfig) when comm.ranks_per_node contradicts the hosts.
ParallelContext make_parallel_context(std::shared_ptr<ProcessGroup> world, GridShape shape);

}  // namespace loom
