// loom's own all-reduce algorithms on MPI point-to-point messages, over f32
// buffers in place. They run on a group's worker thread; `wait` completes
// requests under the group's deadline.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <functional>

#include "loom/comm/process_group.h"

namespace loom::algo {

struct P2p {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::function<void(MPI_Request*, int)> wait;
  double* sent = nullptr;  // when set, the bytes every send of the algorithm posts are added
  void count_sent(size_t elements) const {
    if (sent != nullptr) *sent += static_cast<double>(elements) * sizeof(float);
  }
};

// Tags at or above this value are reserved for the algorithms.
inline constexpr int kAlgoTagBase = 30000;

// Elements [begin, end) of chunk i when `count` is split into `parts` nearly
// equal chunks (the first count % parts chunks one longer).
inline size_t chunk_begin(size_t count, int parts, int i) {
  size_t base = count / static_cast<size_t>(parts), extra = count % static_cast<size_t>(parts);
  size_t ui = static_cast<size_t>(i);
  return ui * base + (ui < extra ? ui : extra);
}

// Ring: reduce-scatter (rank r ends owning chunk r, reduced), then all-gather.
// Each of the 2 (p - 1) steps sends one chunk to the right neighbour and
// receives one from the left, in segments so that the reduction of one
// segment overlaps the transfer of the next.
void ring_reduce_scatter(const P2p& g, float* data, size_t count, ReduceOp op);
void ring_all_gather(const P2p& g, float* data, size_t count);
void ring_all_reduce(const P2p& g, float* data, size_t count, ReduceOp op);

// Recursive halving (reduce-scatter) then doubling (all-gather), log2(p)
// steps each; a non-power-of-two group first folds its extra ranks into
// partners and unfolds them at the end.
void rhd_all_reduce(const P2p& g, float* data, size_t count, ReduceOp op);

// Topology-aware: ring reduce-scatter inside the node, ring all-reduce of each
// shard across nodes (ranks with the same local index), ring all-gather inside
// the node. Needs equal node sizes.
void hierarchical_all_reduce(const P2p& node, const P2p& cross, float* data, size_t count,
                             ReduceOp op);

}  // namespace loom::algo
