#include "loom/parallel/pipeline/partition.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <numeric>

#include "loom/core/error.h"

namespace loom::pp {

std::vector<int> uniform_partition(int n_layer, int parts) {
  LOOM_CHECK_KIND(kConfig, parts >= 1 && n_layer >= parts,
                  "model.n_layer {} is fewer than the {} pipeline parts (parallel.pipeline x "
                  "parallel.virtual_stages); every part needs at least one block",
                  n_layer, parts);
  std::vector<int> c(static_cast<size_t>(parts), n_layer / parts);
  int extra = n_layer % parts;
  // Middle parts first, then the last, then the first.
  std::vector<int> order;
  for (int k = 1; k + 1 < parts; ++k) order.push_back(k);
  if (parts > 1) order.push_back(parts - 1);
  order.push_back(0);
  for (size_t i = 0; extra > 0; i = (i + 1) % order.size(), --extra)
    ++c[static_cast<size_t>(order[i])];
  return c;
}

void check_partition(const std::vector<int>& counts, int n_layer, int parts) {
  LOOM_CHECK_KIND(kConfig, static_cast<int>(counts.size()) == parts,
                  "parallel.partition lists {} layer counts but the pipeline has {} parts "
                  "(parallel.pipeline x parallel.virtual_stages)",
                  counts.size(), parts);
  int sum = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    LOOM_CHECK_KIND(kConfig, counts[k] >= 1,
                    "parallel.partition gives part {} {} layers; every part needs at least one", k,
                    counts[k]);
    sum += counts[k];
  }
  LOOM_CHECK_KIND(kConfig, sum == n_layer,
                  "parallel.partition sums to {} layers but model.n_layer is {}", sum, n_layer);
}

namespace {

// Part k of `parts` holding blocks [a, b): its time, and its peak bytes
// (in_flight micro-batches' activations, the shared room once, its model
// state).
PartCost cost_of_part(const ModelCosts& costs, int k, int parts, int a, int b, double in_flight) {
  double t = 0, act = 0, state = 0, room = 0;
  auto add = [&](const LayerCost& c) {
    t += c.seconds;
    act += c.act_bytes;
    state += c.state_bytes;
    room = std::max(room, c.room_bytes);
  };
  if (k == 0) add(costs.embedding);
  for (int i = a; i < b; ++i) add(costs.blocks.at(static_cast<size_t>(i)));
  if (k == parts - 1) add(costs.head);
  return {t, in_flight * act + room + state};
}

}  // namespace

std::vector<PartCost> part_costs(const ModelCosts& costs, const std::vector<int>& counts,
                                 const std::vector<double>& in_flight) {
  std::vector<PartCost> out;
  const int parts = static_cast<int>(counts.size());
  int first = 0;
  for (int k = 0; k < parts; ++k) {
    const int n = counts[static_cast<size_t>(k)];
    out.push_back(cost_of_part(costs, k, parts, first, first + n, in_flight.at(size_t(k))));
    first += n;
  }
  return out;
}

std::vector<int> balanced_partition(const ModelCosts& costs, int parts,
                                    const std::vector<double>& in_flight, double memory_limit) {
  const int n = static_cast<int>(costs.blocks.size());
  uniform_partition(n, parts);  // the same error when there are too few layers
  // best[k][i]: the least "slowest part" time cutting blocks [0, i) into
  // parts [0, k]; cut[k][i] where part k begins.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(parts, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(parts, std::vector<int>(n + 1, -1));
  auto cost_of = [&](int k, int a, int b) {  // part k holding blocks [a, b)
    const PartCost c = cost_of_part(costs, k, parts, a, b, in_flight.at(static_cast<size_t>(k)));
    return (memory_limit > 0 && c.bytes > memory_limit) ? inf : c.seconds;
  };
  for (int i = 1; i <= n; ++i) best[0][i] = cost_of(0, 0, i);
  for (int k = 1; k < parts; ++k)
    for (int i = k + 1; i <= n; ++i)
      for (int j = k; j < i; ++j) {
        const double t = std::max(best[k - 1][j], cost_of(k, j, i));
        // Ties go to the later cut: fewer blocks beside the embedding.
        if (t <= best[k][i]) best[k][i] = t, cut[k][i] = j;
      }
  LOOM_CHECK_KIND(kConfig, best[parts - 1][n] < inf,
                  "parallel.partition balanced: no cut of {} layers into {} parts keeps every "
                  "part within parallel.stage_memory_bytes = {}",
                  n, parts, static_cast<long long>(memory_limit));
  std::vector<int> counts(static_cast<size_t>(parts));
  for (int k = parts - 1, i = n; k >= 0; --k) {
    const int j = k == 0 ? 0 : cut[k][i];
    counts[static_cast<size_t>(k)] = i - j;
    i = j;
  }
  return counts;
}

double imbalance(const std::vector<PartCost>& parts) {
  if (parts.empty()) return 0;
  double mx = 0, sum = 0;
  for (const PartCost& p : parts) mx = std::max(mx, p.seconds), sum += p.seconds;
  return sum > 0 ? mx / (sum / static_cast<double>(parts.size())) - 1.0 : 0;
}

std::string partition_table(const std::vector<int>& counts, const std::vector<PartCost>& parts) {
  std::string s = "  part  layers         blocks   time (ms)   memory (MB)\n";
  char line[128];
  int first = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    const std::string blocks = format("[{}, {})", first, first + counts[k]);
    std::snprintf(line, sizeof line, "  %4zu  %6d  %13s  %10.2f  %12.1f\n", k, counts[k],
                  blocks.c_str(), parts[k].seconds * 1e3, parts[k].bytes / 1e6);
    s += line;
    first += counts[k];
  }
  std::snprintf(line, sizeof line, "  imbalance (slowest / mean - 1): %.1f%%\n",
                imbalance(parts) * 100);
  return s + line;
}

}  // namespace loom::pp
