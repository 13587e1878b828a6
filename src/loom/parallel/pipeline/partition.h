// Cutting the model's blocks into contiguous pipeline parts: uniform, an
// explicit list of layer counts, or balanced on measured per-layer costs
// (the embedding goes with the first part and the head with the last, and
// with a large vocabulary both are heavy). Pure functions of the numbers,
// unit-tested without processes.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace loom::pp {

// What one piece of the model costs on this machine for one micro-batch.
struct LayerCost {
  double seconds = 0;      // forward + backward
  double act_bytes = 0;    // activations kept from forward to backward
  double state_bytes = 0;  // parameters, gradients and optimizer moments
  // The stage's shared room this layer needs (16-bit records are computed
  // and widened there): a part holds its layers' largest once.
  double room_bytes = 0;
};

struct ModelCosts {
  LayerCost embedding, head;
  std::vector<LayerCost> blocks;  // one per transformer block
};

// n_layer blocks in `parts` parts as equal as can be; the extra blocks go
// to the middle parts first (the first and last carry the embedding and
// the head). Throws Error(kConfig) when there are fewer layers than parts.
std::vector<int> uniform_partition(int n_layer, int parts);

// Checks a user's list of layer counts (parallel.partition), throwing
// Error(kConfig) with the numbers when it has the wrong length, a part
// without layers, or does not sum to n_layer.
void check_partition(const std::vector<int>& counts, int n_layer, int parts);

// The contiguous cut into `parts` parts (each with at least one block) that
// minimises the slowest part's time; part k keeps in_flight[k] micro-batches'
// activations at its peak, and no part may exceed memory_limit bytes (0: no
// limit). Throws Error(kConfig) when no cut fits the limit.
std::vector<int> balanced_partition(const ModelCosts& costs, int parts,
                                    const std::vector<double>& in_flight, double memory_limit);

struct PartCost {
  double seconds = 0, bytes = 0;
};
// Time and peak memory of each part of a cut.
std::vector<PartCost> part_costs(const ModelCosts& costs, const std::vector<int>& counts,
                                 const std::vector<double>& in_flight);
// max over parts / mean over parts of the time, minus one (0: perfect).
double imbalance(const std::vector<PartCost>& parts);
// The table a run prints: layers, predicted time and memory per part, and the imbalance.
std::string partition_table(const std::vector<int>& counts, const std::vector<PartCost>& parts);

}  // namespace loom::pp
