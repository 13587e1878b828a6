#include "loom/comm/parallel_context.h"

#include <numeric>
#include <string>

#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/core/error.h"

namespace loom {

namespace {
// The hosts of the members of `g`, indexed by rank in g.
Topology group_topology(const MpiProcessGroup& g) {
  const Topology& all = g.runtime()->topology();
  Topology t;
  std::vector<int> index(static_cast<size_t>(all.hosts()), -1);
  for (int world_rank : g.members()) {
    int& h = index[static_cast<size_t>(all.host_of[static_cast<size_t>(world_rank)])];
    if (h < 0) {
      h = t.hosts();
      t.names.push_back(
          all.names[static_cast<size_t>(all.host_of[static_cast<size_t>(world_rank)])]);
    }
    t.host_of.push_back(h);
  }
  return t;
}

// Places the ranks of `world` on the grid; returns the world in grid order.
std::shared_ptr<MpiProcessGroup> place(std::shared_ptr<MpiProcessGroup> world,
                                       ParallelContext& ctx) {
  const CommOptions& o = world->options();
  LOOM_CHECK_KIND(kConfig, o.placement == "topology" || o.placement == "launcher",
                  "comm.placement: unknown value '{}' (topology, launcher)", o.placement);
  ctx.topology = group_topology(*world);
  ctx.launch_rank = world->rank();
  ctx.order.resize(static_cast<size_t>(world->size()));
  std::iota(ctx.order.begin(), ctx.order.end(), 0);
  if (o.placement == "topology") ctx.order = topology_order(ctx.topology);
  check_ranks_per_node(o.ranks_per_node, ctx.topology, ctx.order);
  ctx.placement = ctx.topology.describe();
  bool moved = false;
  for (size_t g = 0; g < ctx.order.size(); ++g) moved |= ctx.order[g] != static_cast<int>(g);
  if (moved) {
    std::string map;
    for (size_t g = 0; g < ctx.order.size(); ++g)
      map += format("{}{}<-{}", g == 0 ? "" : " ", g, ctx.order[g]);
    ctx.placement += format("; placed host by host (grid rank <- launch rank: {})", map);
    return world->split({ctx.order}, "world");
  }
  ctx.placement += o.placement == "topology" ? "; launch order kept (already host by host)"
                                             : "; launch order kept (comm.placement launcher)";
  return world;
}
}  // namespace

ParallelContext make_parallel_context(std::shared_ptr<ProcessGroup> world, GridShape shape) {
  shape.world = world ? world->size() : 1;
  ParallelContext ctx;
  ctx.grid = Grid(shape);
  ctx.launch_world = world;
  if (auto mpi = std::dynamic_pointer_cast<MpiProcessGroup>(world); mpi && mpi->size() > 1)
    world = place(mpi, ctx);
  ctx.rank = world ? world->rank() : 0;
  ctx.world = world;
  if (!world) return ctx;
  std::vector<int> per_host;
  for (int h = 0; h < ctx.topology.hosts(); ++h)
    per_host.push_back(static_cast<int>(ctx.topology.ranks_on(h).size()));
  for (const std::string kind : {"tp", "ep"}) {
    const auto all = ctx.grid.all_groups(kind);
    auto spans = groups_spanning_hosts(all, ctx.topology, ctx.order);
    if (spans.empty() || all.front().size() == 1) continue;
    std::string list;
    for (const auto& s : spans) list += (list.empty() ? "" : "; ") + s;
    ctx.warnings.push_back(
        format("{} {}-parallel group{} of {} span hosts: {} (their collectives cross the network; "
               "the hosts hold {} ranks)",
               spans.size(), kind == "tp" ? "tensor" : "expert", spans.size() == 1 ? "" : "s",
               all.front().size(), list, rank_list(per_host)));
  }
  // own: a communicator of its own even when the group is the whole world
  // (its operations then never queue behind the world's on its worker).
  // name: the communicator's, which the record of collectives and the
  // metrics show (the kind's unless given).
  auto group = [&](const std::string& kind, bool own = false,
                   const std::string& name = {}) -> std::shared_ptr<ProcessGroup> {
    const std::vector<std::vector<int>> all = ctx.grid.all_groups(kind);
    if (all.front().size() == 1) return nullptr;
    if (static_cast<int>(all.front().size()) == world->size() && !own) return world;
    auto mpi = std::dynamic_pointer_cast<MpiProcessGroup>(world);
    LOOM_CHECK_KIND(kUnsupported, mpi != nullptr,
                    "process group backend '{}' cannot split off {} groups", world->name(), kind);
    return mpi->split(all, name.empty() ? kind : name);
  };
  ctx.tp = group("tp");
  // (Named "dp": it is the data-parallel reduction's group, cp or not.)
  ctx.dp = group("dp_cp", false, "dp");
  // The context-parallel ring runs inside each layer's forward and backward:
  // it must not queue behind gradient reductions on another group's worker.
  ctx.cp = group("cp", true);
  ctx.pp = group("pp");
  ctx.model_parallel = group("mp");
  ctx.embedding = group("embedding");
  // The MoE all-to-alls block their layer: they must not wait behind
  // gradient reductions in flight on the data-parallel group's worker.
  ctx.ep = group("ep", true);
  ctx.ep_dp = group("ep_dp");
  return ctx;
}

}  // namespace loom
