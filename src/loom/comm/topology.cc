#include "loom/comm/topology.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "loom/core/error.h"

namespace loom {

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

std::vector<int> Topology::ranks_on(int host) const {
  std::vector<int> r;
  for (int i = 0; i < world(); ++i)
    if (host_of[static_cast<size_t>(i)] == host) r.push_back(i);
  return r;
}

std::string Topology::describe() const {
  std::string s = format("{} host{}:", hosts(), hosts() == 1 ? "" : "s");
  for (int h = 0; h < hosts(); ++h)
    s += format("{} {} (rank{} {})", h == 0 ? "" : ",", names[static_cast<size_t>(h)],
                ranks_on(h).size() == 1 ? "" : "s", rank_list(ranks_on(h)));
  return s;
}

Topology single_host(int world, const std::string& name) {
  return Topology{std::vector<int>(static_cast<size_t>(world), 0), {name}};
}

std::vector<int> topology_order(const Topology& t) {
  std::vector<int> order(static_cast<size_t>(t.world()));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return t.host_of[static_cast<size_t>(a)] < t.host_of[static_cast<size_t>(b)];
  });
  return order;
}

std::vector<std::string> groups_spanning_hosts(const std::vector<std::vector<int>>& groups,
                                               const Topology& t, const std::vector<int>& order) {
  std::vector<std::string> out;
  for (const auto& g : groups) {
    std::vector<int> ranks;
    std::set<int> hosts;
    for (int grid_rank : g) {
      int r = order[static_cast<size_t>(grid_rank)];
      ranks.push_back(r);
      hosts.insert(t.host_of[static_cast<size_t>(r)]);
    }
    if (hosts.size() < 2) continue;
    std::string names;
    for (int h : hosts) names += (names.empty() ? "" : ", ") + t.names[static_cast<size_t>(h)];
    out.push_back(format("ranks {} ({})", rank_list(ranks), names));
  }
  return out;
}

void check_ranks_per_node(int rpn, const Topology& t, const std::vector<int>& order) {
  if (rpn <= 0) return;
  LOOM_CHECK_KIND(kConfig, t.world() % rpn == 0,
                  "comm.ranks_per_node = {} does not divide the {} ranks of this job ({})", rpn,
                  t.world(), t.describe());
  for (int first = 0; first < t.world(); first += rpn) {
    std::vector<int> block(static_cast<size_t>(rpn));
    std::iota(block.begin(), block.end(), first);
    auto spans = groups_spanning_hosts({block}, t, order);
    LOOM_CHECK_KIND(kConfig, spans.empty(),
                    "comm.ranks_per_node = {} contradicts the hosts of this job: a node of {} "
                    "ranks would hold {}, but the job has {}; leave comm.ranks_per_node at 0 "
                    "(the hosts MPI reports) or make it divide the ranks of every host",
                    rpn, rpn, spans.empty() ? std::string() : spans.front(), t.describe());
  }
}

}  // namespace loom
