#include "loom/comm/parallel_context.h"

#include <string>

#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/core/error.h"

namespace loom {

ParallelContext make_parallel_context(std::shared_ptr<ProcessGroup> world, GridShape shape) {
  shape.world = world ? world->size() : 1;
  ParallelContext ctx;
  ctx.grid = Grid(shape);
  ctx.rank = world ? world->rank() : 0;
  ctx.world = world;
  if (!world) return ctx;
  // own: a communicator of its own even when the group is the whole world
  // (its operations then never queue behind the world's on its worker).
  auto group = [&](const std::string& kind, bool own = false) -> std::shared_ptr<ProcessGroup> {
    const std::vector<std::vector<int>> all = ctx.grid.all_groups(kind);
    if (all.front().size() == 1) return nullptr;
    if (static_cast<int>(all.front().size()) == world->size() && !own) return world;
    auto mpi = std::dynamic_pointer_cast<MpiProcessGroup>(world);
    LOOM_CHECK_KIND(kUnsupported, mpi != nullptr,
                    "process group backend '{}' cannot split off {} groups", world->name(), kind);
    return mpi->split(all, kind);
  };
  ctx.tp = group("tp");
  ctx.dp = group("dp");
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
