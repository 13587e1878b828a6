// The rank grid without processes: Megatron-LM's order for many shapes, every
// group a partition of the world, and invalid shapes rejected with numbers.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "loom/comm/grid.h"
#include "loom/comm/process_group.h"
#include "loom/comm/record.h"
#include "loom/comm/topology.h"
#include "loom/core/error.h"
#include "loom/kernels/cpu/cpu_backend.h"
#include "loom/parallel/zero/comm_wait.h"

namespace loom {
namespace {

using V = std::vector<int>;

TEST(Grid, MegatronOrderTensorFastestThenDataThenPipeline) {
  // 16 ranks, tp 2, pp 4 -> dp 2; Megatron-LM's documented example.
  Grid g({16, 2, 4, 1});
  EXPECT_EQ(g.shape().dp(), 2);
  EXPECT_EQ(g.all_groups("tp"),
            (std::vector<V>{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(g.all_groups("dp"),
            (std::vector<V>{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(g.all_groups("pp"),
            (std::vector<V>{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(g.embedding_group(5), (V{1, 13}));
  EXPECT_EQ(g.model_parallel_group(0), (V{0, 1, 4, 5, 8, 9, 12, 13}));
  GridCoord c = g.coord(11);
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 2);
  EXPECT_EQ(g.rank_of(1, 1, 2), 11);
}

TEST(Grid, ExpertGroupsAreCarvedOutOfDataParallel) {
  Grid g({8, 1, 1, 4});  // dp 8, ep 4
  EXPECT_EQ(g.all_groups("ep"), (std::vector<V>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(g.all_groups("ep_dp"), (std::vector<V>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  Grid h({16, 2, 2, 2});  // dp 4, ep 2: within each dp group
  EXPECT_EQ(h.dp_group(1), (V{1, 3, 5, 7}));
  EXPECT_EQ(h.ep_group(5), (V{5, 7}));
  EXPECT_EQ(h.ep_dp_group(5), (V{1, 5}));
}

// Megatron-LM's order with context parallelism: tp, then cp, then dp, then
// pp; the dp x cp ranks of a replica hold the same parameters.
TEST(Grid, ContextParallelSitsBetweenTensorAndData) {
  Grid g({16, 2, 2, 1, 2});  // tp 2, pp 2, cp 2 -> dp 2
  EXPECT_EQ(g.shape().dp(), 2);
  EXPECT_EQ(g.all_groups("tp").front(), (V{0, 1}));
  EXPECT_EQ(g.all_groups("cp"),
            (std::vector<V>{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(g.dp_group(0), (V{0, 4}));
  EXPECT_EQ(g.dp_cp_group(1), (V{1, 3, 5, 7}));
  EXPECT_EQ(g.pp_group(3), (V{3, 11}));
  EXPECT_EQ(g.model_parallel_group(2), (V{2, 3, 10, 11}));
  EXPECT_EQ(g.embedding_group(2), (V{2, 10}));
  const GridCoord c = g.coord(7);  // tp 1, cp 1, dp 1, pp 0
  EXPECT_EQ(c.tp, 1);
  EXPECT_EQ(c.cp, 1);
  EXPECT_EQ(c.dp, 1);
  EXPECT_EQ(c.pp, 0);
  EXPECT_EQ(g.rank_of(1, 1, 0, 1), 7);
  EXPECT_EQ(g.describe(), "world 16 = tp 2 x cp 2 x dp 2 x pp 2 (ep 1)");
  // Experts come out of the dp x cp ranks.
  Grid e({8, 1, 1, 4, 2});  // cp 2, dp 4, ep 4
  EXPECT_EQ(e.ep_group(5), (V{4, 5, 6, 7}));
  EXPECT_EQ(e.ep_dp_group(5), (V{1, 5}));
}

TEST(Grid, EveryKindPartitionsTheWorldForManyShapes) {
  for (int world : {1, 2, 4, 6, 8, 12, 16, 24, 32, 64}) {
    for (int tp = 1; tp <= world; ++tp) {
      for (int pp = 1; tp * pp <= world; ++pp) {
        if (world % (tp * pp) != 0) continue;
        const int rest = world / (tp * pp);
        for (int cp = 1; cp <= rest; ++cp) {
          if (rest % cp != 0) continue;
          const int dp = rest / cp;
          for (int ep = 1; ep <= rest; ++ep) {
            if (rest % ep != 0) continue;
            Grid g({world, tp, pp, ep, cp});
            for (const char* kind : {"tp", "cp", "dp", "dp_cp", "pp", "mp", "ep", "ep_dp"}) {
              std::vector<int> count(world, 0);
              for (const auto& group : g.all_groups(kind))
                for (int r : group) count[r]++;
              for (int r = 0; r < world; ++r)
                ASSERT_EQ(count[r], 1)
                    << kind << " world " << world << " tp " << tp << " pp " << pp << " cp " << cp;
            }
            for (int r = 0; r < world; ++r) {
              GridCoord c = g.coord(r);
              ASSERT_EQ(g.rank_of(c.tp, c.dp, c.pp, c.cp), r);
              ASSERT_EQ(static_cast<int>(g.tp_group(r).size()), tp);
              ASSERT_EQ(static_cast<int>(g.cp_group(r).size()), cp);
              ASSERT_EQ(static_cast<int>(g.dp_group(r).size()), dp);
              ASSERT_EQ(static_cast<int>(g.dp_cp_group(r).size()), dp * cp);
              ASSERT_EQ(static_cast<int>(g.pp_group(r).size()), pp);
              ASSERT_EQ(static_cast<int>(g.ep_group(r).size()), ep);
              ASSERT_EQ(static_cast<int>(g.model_parallel_group(r).size()), tp * pp);
              auto tpg = g.tp_group(r);
              ASSERT_TRUE(std::find(tpg.begin(), tpg.end(), r) != tpg.end());
            }
          }
        }
      }
    }
  }
}

std::string error_of(GridShape s) {
  try {
    Grid g(s);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Grid, InvalidShapesGiveNumbersAndNearestChoices) {
  EXPECT_EQ(error_of({6, 4, 1, 1}),
            "world size 6 is not divisible by parallel.tensor 4 x parallel.pipeline 1 = 4; with "
            "parallel.pipeline 1, parallel.tensor must divide 6: 1, 2, 3, 6 (nearest: 3 or 6)");
  EXPECT_EQ(error_of({8, 1, 3, 1}),
            "world size 8 is not divisible by parallel.tensor 1 x parallel.pipeline 3 = 3; "
            "parallel.pipeline must divide the world size: 1, 2, 4, 8 (nearest: 2 or 4)");
  EXPECT_EQ(error_of({8, 2, 1, 3}),
            "parallel.expert 3 does not divide the data-parallel size 4 (world 8 / (tp 2 x pp "
            "1)); valid expert sizes: 1, 2, 4; nearest: 2 or 4");
  EXPECT_EQ(error_of({8, 2, 1, 1, 3}),
            "parallel.context 3 does not divide world 8 / (tp 2 x pp 1) = 4; valid context "
            "sizes: 1, 2, 4; nearest: 2 or 4");
  EXPECT_EQ(error_of({8, 1, 1, 3, 2}),
            "parallel.expert 3 does not divide the data-parallel x context-parallel size 8 (world "
            "8 / (tp 1 x pp 1)); valid expert sizes: 1, 2, 4, 8; nearest: 2 or 4");
}

// The record keeps the newest events when nobody takes them, and counts
// what it dropped; totals add per group in order of first appearance.
TEST(CommRecord, KeepsTheNewestAndCountsTheDropped) {
  CommRecord rec(3);
  for (int i = 0; i < 5; ++i) {
    CommEvent e;
    e.group = i % 2 ? "tp" : "dp";
    e.sent_bytes = i;
    e.started = i, e.ended = i + 0.5;
    rec.add(e);
  }
  EXPECT_EQ(rec.dropped(), 2u);
  const std::vector<CommEvent> ev = rec.take();
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0].sent_bytes, 2);
  EXPECT_EQ(ev[2].sent_bytes, 4);
  EXPECT_TRUE(rec.take().empty());
  const std::vector<CommTotals> t = totals_by_group(ev);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].group, "dp");
  EXPECT_EQ(t[0].ops, 2);
  EXPECT_EQ(t[0].sent_bytes, 6);
  EXPECT_EQ(t[0].seconds, 1.0);
  EXPECT_EQ(t[1].group, "tp");
  EXPECT_EQ(t[1].sent_bytes, 3);
  EXPECT_THROW(CommRecord(0), Error);
}

// A device-ordered Work (its backend completes on a device): test() is true
// only once the device has passed the event, wait() blocks for it, and a
// consumer that computes with the result next orders its backend after the
// event instead (wait_for_use), without blocking the host on it.
class FakeEvent final : public DeviceEvent {
 public:
  Device device() const override { return Device::kCuda; }
  bool query() const override { return passed; }
  void synchronize() const override {
    ++synchronized;
    passed = true;
  }
  mutable bool passed = false;
  mutable int synchronized = 0;
};

TEST(Work, ADeviceOrderedCompletionIsPassedWhenTheDeviceIsAndOrdersTheConsumer) {
  auto ev = std::make_shared<FakeEvent>();
  auto w = std::make_shared<Work>();
  w->set_event(ev);
  EXPECT_FALSE(w->test());
  w->finish(0.5);
  EXPECT_FALSE(w->test()) << "done on the host, not yet on the device";
  w->wait_host();
  EXPECT_EQ(ev->synchronized, 0) << "wait_host leaves the device alone";
  // The CPU backend has no stream to order: it waits for the event.
  const CpuBackend<float> cpu;
  CommStats stats;
  wait_for_use(w, cpu, &stats);
  EXPECT_EQ(ev->synchronized, 1);
  EXPECT_EQ(stats.comm_s, 0.5);
  EXPECT_TRUE(w->test());
  w->wait();
  EXPECT_EQ(ev->synchronized, 2);
  // A host operation carries no event and asks nothing of the consumer.
  auto host = std::make_shared<Work>();
  host->finish(0);
  wait_for_use(host, cpu);
  EXPECT_TRUE(host->test());
  EXPECT_EQ(host->event(), nullptr);
}

}  // namespace
}  // namespace loom

// --- topology: which ranks share a host, and where they sit on the grid ---

namespace {
loom::Topology hosts_of(std::vector<int> host_of, int hosts) {
  loom::Topology t;
  t.host_of = std::move(host_of);
  for (int h = 0; h < hosts; ++h) t.names.push_back("node" + std::to_string(h));
  return t;
}
}  // namespace

TEST(Topology, RoundRobinLaunchIsPlacedHostByHost) {
  // mpirun --map-by node on 2 hosts x 2 slots: ranks 0, 2 on node0; 1, 3 on node1.
  loom::Topology t = hosts_of({0, 1, 0, 1}, 2);
  EXPECT_EQ(t.describe(), "2 hosts: node0 (ranks 0, 2), node1 (ranks 1, 3)");
  std::vector<int> order = loom::topology_order(t);
  EXPECT_EQ(order, (std::vector<int>{0, 2, 1, 3}));
  // tp 2: grid ranks {0,1} and {2,3} are launch ranks {0,2} (node0) and {1,3} (node1).
  loom::Grid g(loom::GridShape{4, 2});
  EXPECT_TRUE(loom::groups_spanning_hosts(g.all_groups("tp"), t, order).empty());
  // In launch order they would both span the hosts.
  std::vector<int> launch = {0, 1, 2, 3};
  EXPECT_EQ(loom::groups_spanning_hosts(g.all_groups("tp"), t, launch),
            (std::vector<std::string>{"ranks 0, 1 (node0, node1)", "ranks 2, 3 (node0, node1)"}));
}

TEST(Topology, SlotOrderIsKeptAndRankZeroStaysFirst) {
  loom::Topology t = hosts_of({0, 0, 1, 1, 2, 2}, 3);
  EXPECT_EQ(loom::topology_order(t), (std::vector<int>{0, 1, 2, 3, 4, 5}));
  // Unequal hosts (3 + 1): a tp group of 2 spans them and is named.
  loom::Topology u = hosts_of({0, 0, 0, 1}, 2);
  std::vector<int> order = loom::topology_order(u);
  EXPECT_EQ(order.front(), 0);
  loom::Grid g(loom::GridShape{4, 2});
  EXPECT_EQ(loom::groups_spanning_hosts(g.all_groups("tp"), u, order),
            (std::vector<std::string>{"ranks 2, 3 (node0, node1)"}));
}

TEST(Topology, RanksPerNodeMustRefineTheHosts) {
  loom::Topology one = loom::single_host(4);
  loom::check_ranks_per_node(2, one, loom::topology_order(one));  // emulated nodes inside a host
  loom::check_ranks_per_node(0, one, loom::topology_order(one));
  loom::Topology two = hosts_of({0, 0, 1, 1}, 2);
  loom::check_ranks_per_node(1, two, loom::topology_order(two));
  loom::check_ranks_per_node(2, two, loom::topology_order(two));
  try {
    loom::check_ranks_per_node(4, two, loom::topology_order(two));
    FAIL() << "no error";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "comm.ranks_per_node = 4 contradicts the hosts of this job: a node of 4 ranks "
                  "would hold ranks 0, 1, 2, 3 (node0, node1), but the job has 2 hosts: node0 "
                  "(ranks 0, 1), node1 (ranks 2, 3)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(loom::check_ranks_per_node(3, two, loom::topology_order(two)), loom::Error);
}
