// Which ranks of a job share a host, and where each one sits on the rank
// grid. The hosts come from the job itself (MPI's shared-memory split and
// processor names, see MpiRuntime); everything here is a pure function of
// them, unit-tested without processes.
#pragma once

#include <string>
#include <vector>

namespace loom {

struct Topology {
  // Launch rank (the rank the launcher gave the process) -> host index.
  // Hosts are numbered in the order of their lowest rank, so the host of
  // rank 0 is host 0.
  std::vector<int> host_of;
  std::vector<std::string> names;  // host index -> name ("node0")

  int world() const { return static_cast<int>(host_of.size()); }
  int hosts() const { return static_cast<int>(names.size()); }
  std::vector<int> ranks_on(int host) const;  // launch ranks, ascending
  // "2 hosts: node0 (ranks 0, 1), node1 (ranks 2, 3)"
  std::string describe() const;
};

// One host holding every rank (one process, or a topology nobody measured).
Topology single_host(int world, const std::string& name = "localhost");

// Grid placement, order[g] = the launch rank placed at grid rank g: ranks
// sorted by host (hosts in the order of their lowest rank), ascending
// inside a host. Consecutive grid ranks, which form the tensor-parallel
// groups and then the expert-parallel ones (grid.h), so share a host
// whatever order the launcher dealt the ranks in (by slot, or round-robin
// with --map-by node); launch rank 0 stays grid rank 0.
std::vector<int> topology_order(const Topology& t);

// The groups (lists of grid ranks) whose members sit on more than one host,
// each as "ranks 0, 2 (node0, node1)" in launch ranks.
std::vector<std::string> groups_spanning_hosts(const std::vector<std::vector<int>>& groups,
                                               const Topology& t, const std::vector<int>& order);

// comm.ranks_per_node emulates smaller nodes inside the real hosts (blocks
// of that many consecutive grid ranks). Throws Error(kConfig) when it does
// not divide the world or a block would span real hosts.
void check_ranks_per_node(int ranks_per_node, const Topology& t, const std::vector<int>& order);

// "0, 1, 2" for a list of ranks.
std::string rank_list(const std::vector<int>& ranks);

}  // namespace loom
