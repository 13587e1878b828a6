// The MPI runtime for tests under mpirun: one per process, created in main().
#pragma once

#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "loom/comm/mpi/mpi_process_group.h"

namespace loom::test {
MpiRuntime& runtime();

// Groups of every size 1..world: the world, and world ranks [0, k) and
// [k, world) for every k.
inline std::vector<std::shared_ptr<MpiProcessGroup>> groups_of_every_size(const CommOptions& opt) {
  auto world = runtime().world(opt);
  std::vector<std::shared_ptr<MpiProcessGroup>> out{world};
  for (int k = 1; k < world->size(); ++k) {
    std::vector<int> a(static_cast<size_t>(k)), b(static_cast<size_t>(world->size() - k));
    std::iota(a.begin(), a.end(), 0);
    std::iota(b.begin(), b.end(), k);
    out.push_back(world->split({a, b}, "split" + std::to_string(k)));
  }
  return out;
}
}  // namespace loom::test
