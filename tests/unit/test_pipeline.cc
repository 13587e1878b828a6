// Pipeline schedules without processes: every generator's lists simulated
// against each other (each micro-batch forwarded and backwarded once per
// chunk, sends matching receives, no deadlock), the in-flight peaks the
// schedules promise, bubbles against theory, and the partitioner.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "loom/core/error.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/parallel/pipeline/schedule.h"
#include "loom/train/config.h"

namespace loom::pp {
namespace {

struct Case {
  ScheduleKind kind;
  int p, m, v;
};

std::vector<Case> all_cases() {
  std::vector<Case> c;
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {1, 2, 3, 4, 8, 16}) {
      c.push_back({ScheduleKind::kGpipe, p, m, 1});
      c.push_back({ScheduleKind::k1F1B, p, m, 1});
      c.push_back({ScheduleKind::kZeroBubble, p, m, 1});
      for (int v : {2, 3, 4})
        if (m % p == 0) c.push_back({ScheduleKind::kInterleaved, p, m, v});
    }
  return c;
}

TEST(Schedule, EveryGeneratorRunsEveryMicroBatchOnceWithoutDeadlock) {
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(format("{} p {} m {} v {}", schedule_name(c.kind), c.p, c.m, c.v));
    const Schedule s = make_schedule(c.kind, c.p, c.m, c.v);
    ASSERT_EQ(static_cast<int>(s.per_stage.size()), c.p);
    // simulate() throws on any violation; count the compute instructions too.
    const SimResult r = simulate(s);
    for (int st = 0; st < c.p; ++st) {
      int compute = 0, sends = 0, recvs = 0;
      for (const Instr& in : s.per_stage[st]) {
        compute += is_compute(in.op);
        sends += in.op == Op::kSendAct || in.op == Op::kSendGrad;
        recvs += in.op == Op::kRecvAct || in.op == Op::kRecvGrad;
      }
      const int per_mb = c.kind == ScheduleKind::kZeroBubble ? 3 : 2;
      EXPECT_EQ(compute, per_mb * c.m * s.chunks);
      EXPECT_EQ(sends, recvs);  // a stage sends as much as it receives, by symmetry of the model
      EXPECT_EQ(s.per_stage[st].back().op, Op::kOptimizerStep);
    }
    EXPECT_GT(r.makespan, 0);
  }
}

TEST(Schedule, PeakMicroBatchesInFlight) {
  for (int p : {2, 4})
    for (int m : {4, 8, 16}) {
      const SimResult g = simulate(make_schedule(ScheduleKind::kGpipe, p, m));
      const SimResult o = simulate(make_schedule(ScheduleKind::k1F1B, p, m));
      for (int st = 0; st < p; ++st) {
        EXPECT_EQ(g.peak_in_flight[st], m) << "gpipe stage " << st;
        EXPECT_EQ(o.peak_in_flight[st], std::min(p - st, m)) << "1f1b stage " << st;
      }
      EXPECT_EQ(o.peak_in_flight[0], p);
    }
}

TEST(Schedule, BubblesMatchTheoryWithEqualStages) {
  // Backward twice forward (the usual ratio): GPipe and 1F1B idle
  // (p-1)/(m+p-1); interleaving cuts the bubble by about v.
  const SimCosts costs{1, 2, 1, 1, 0};
  for (int p : {2, 4})
    for (int m : {4, 8, 16}) {
      SCOPED_TRACE(format("p {} m {}", p, m));
      const double theory = theoretical_bubble(ScheduleKind::k1F1B, p, m, 1);
      EXPECT_NEAR(simulate(make_schedule(ScheduleKind::kGpipe, p, m), costs).bubble_fraction(),
                  theory, 1e-9);
      EXPECT_NEAR(simulate(make_schedule(ScheduleKind::k1F1B, p, m), costs).bubble_fraction(),
                  theory, 1e-9);
      const double inter =
          simulate(make_schedule(ScheduleKind::kInterleaved, p, m, 2), costs).bubble_fraction();
      EXPECT_LT(inter, theory);
      EXPECT_NEAR(inter, theoretical_bubble(ScheduleKind::kInterleaved, p, m, 2), 0.03);
      // Zero-bubble with B and W of a forward's cost each: (p - 1) idle
      // units of time instead of 1F1B's 3 (p - 1).
      const double zb =
          simulate(make_schedule(ScheduleKind::kZeroBubble, p, m), costs).bubble_fraction();
      EXPECT_NEAR(zb, theoretical_bubble(ScheduleKind::kZeroBubble, p, m, 1), 1e-9);
      EXPECT_LT(zb, 0.5 * theory);
    }
}

TEST(Schedule, OneFOneBHasThreePhases) {
  // Stage 0 of 4 with 6 micro-batches: 3 warm-up forwards, then alternating.
  const Schedule s = make_schedule(ScheduleKind::k1F1B, 4, 6);
  std::string order;
  for (const Instr& in : s.per_stage[0])
    if (is_compute(in.op)) order += in.describe() + " ";
  EXPECT_EQ(order, "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0 ");
  // Receives sit one compute ahead of their consumer.
  const std::vector<Instr>& last = s.per_stage[3];
  EXPECT_EQ(last[0].describe(), "recv_act 0.0");
  EXPECT_EQ(last[1].describe(), "F0.0");
  EXPECT_EQ(last[2].describe(), "recv_act 1.0");  // posted before B0 runs
  EXPECT_EQ(last[3].describe(), "B0.0");
}

TEST(Schedule, BadInputIsRefusedWithTheNumbers) {
  try {
    make_schedule(ScheduleKind::kInterleaved, 4, 6, 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("6 micro-batches"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("parallel.pipeline = 4"), std::string::npos);
  }
  EXPECT_THROW(parse_schedule("pipedream"), Error);
  EXPECT_EQ(parse_schedule("zero_bubble"), ScheduleKind::kZeroBubble);
}

TEST(Schedule, SimulatorCatchesBrokenLists) {
  Schedule s = make_schedule(ScheduleKind::k1F1B, 2, 2);
  Schedule bad = s;
  std::vector<Instr>& l = bad.per_stage[0];
  std::swap(l[0], l[1]);  // forward 0 after its send
  EXPECT_THROW(simulate(bad), Error);
  Schedule dup = s;
  dup.per_stage[1].insert(dup.per_stage[1].begin() + 2, dup.per_stage[1][2]);
  EXPECT_THROW(simulate(dup), Error);
}

}  // namespace
}  // namespace loom::pp

namespace loom::pp {
namespace {

ModelCosts equal_blocks(int n, double block, double emb, double head) {
  ModelCosts c;
  c.embedding = {emb, 0, 0};
  c.head = {head, 0, 0};
  c.blocks.assign(static_cast<size_t>(n), LayerCost{block, 1, 0});
  return c;
}

TEST(Partition, UniformSpreadsExtrasOverTheMiddle) {
  EXPECT_EQ(uniform_partition(8, 4), (std::vector<int>{2, 2, 2, 2}));
  EXPECT_EQ(uniform_partition(10, 4), (std::vector<int>{2, 3, 3, 2}));
  EXPECT_EQ(uniform_partition(5, 2), (std::vector<int>{2, 3}));
  try {
    uniform_partition(3, 4);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.n_layer 3 is fewer than the 4"), std::string::npos)
        << e.what();
  }
}

TEST(Partition, ExplicitListsAreChecked) {
  check_partition({1, 3}, 4, 2);
  auto message = [](std::vector<int> c, int n, int parts) {
    try {
      check_partition(c, n, parts);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({1, 2}, 4, 2).find("sums to 3 layers but model.n_layer is 4"),
            std::string::npos);
  EXPECT_NE(message({4}, 4, 2).find("lists 1 layer counts but the pipeline has 2"),
            std::string::npos);
  EXPECT_NE(message({4, 0}, 4, 2).find("part 1 0 layers"), std::string::npos);
}

TEST(Partition, BalancedMovesBlocksAwayFromAHeavyHead) {
  // 8 blocks of 1 ms, a 3 ms head: the last part takes fewer blocks
  // (uniform's slowest part is 7 ms, this cut's 6).
  const ModelCosts c = equal_blocks(8, 1, 0.5, 3);
  const std::vector<double> flight{1, 1};
  const std::vector<int> cut = balanced_partition(c, 2, flight, 0);
  EXPECT_EQ(cut, (std::vector<int>{5, 3}));
  const auto uni = part_costs(c, uniform_partition(8, 2), flight);
  const auto bal = part_costs(c, cut, flight);
  EXPECT_NEAR(bal[0].seconds, 5.5, 1e-12);
  EXPECT_NEAR(bal[1].seconds, 6.0, 1e-12);
  EXPECT_LT(imbalance(bal), imbalance(uni));
  // Brute force agrees on the slowest part for every split of 8 into 2..4.
  for (int parts = 2; parts <= 4; ++parts) {
    std::vector<double> f(static_cast<size_t>(parts), 1);
    const auto got = part_costs(c, balanced_partition(c, parts, f, 0), f);
    double best = 1e30;
    std::vector<int> counts(static_cast<size_t>(parts), 1);
    std::function<void(int, int)> rec = [&](int k, int left) {
      if (k == parts - 1) {
        if (left < 1) return;
        counts[static_cast<size_t>(k)] = left;
        double mx = 0;
        for (const PartCost& p : part_costs(c, counts, f)) mx = std::max(mx, p.seconds);
        best = std::min(best, mx);
        return;
      }
      for (int x = 1; x < left; ++x) counts[static_cast<size_t>(k)] = x, rec(k + 1, left - x);
    };
    rec(0, 8);
    double mx = 0;
    for (const PartCost& p : got) mx = std::max(mx, p.seconds);
    EXPECT_NEAR(mx, best, 1e-12) << parts;
  }
  EXPECT_NE(partition_table(cut, bal).find("imbalance"), std::string::npos);
}

TEST(Partition, MemoryLimitConstrainsTheCut) {
  // The first part holds 4 micro-batches' activations (1F1B), the second one.
  ModelCosts c = equal_blocks(8, 1, 0, 0);
  const std::vector<double> flight{4, 1};
  EXPECT_EQ(balanced_partition(c, 2, flight, 0), (std::vector<int>{4, 4}));
  EXPECT_EQ(balanced_partition(c, 2, flight, 12), (std::vector<int>{3, 5}));
  EXPECT_THROW(balanced_partition(c, 2, flight, 3), Error);
}

// A part holds its layers' shared room once (16-bit records are computed
// and widened there), not once per micro-batch in flight or per block.
TEST(Partition, TheSharedRoomCountsOncePerPart) {
  ModelCosts c = equal_blocks(8, 1, 0, 0);
  for (LayerCost& b : c.blocks) b.room_bytes = 0.5;
  c.blocks[5].room_bytes = 2;
  const auto got = part_costs(c, {4, 4}, {4, 1});
  EXPECT_EQ(got[0].bytes, 4 * 4 + 0.5);
  EXPECT_EQ(got[1].bytes, 1 * 4 + 2.0);
  // With the memory limit: 12 fit 3 blocks at 4 in flight plus their room
  // no longer, so the cut moves a block further.
  EXPECT_EQ(balanced_partition(c, 2, {4, 1}, 12.5), (std::vector<int>{3, 5}));
  EXPECT_EQ(balanced_partition(c, 2, {4, 1}, 12), (std::vector<int>{2, 6}));
}

}  // namespace
}  // namespace loom::pp

// The pipeline's keys: bad combinations refused at load, with the numbers.
namespace loom {
namespace {

std::string config_error(const std::vector<std::string>& o, int world) {
  try {
    parse_config(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                     "model": {"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 64,
                               "seq_len": 8},
                     "data": {"synthetic": true}})",
                 "f.json", o, world);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, PipelineKeysAreChecked) {
  EXPECT_EQ(config_error({"parallel.pipeline=2"}, 2), "");
  EXPECT_EQ(
      config_error(
          {"parallel.pipeline=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"}, 2),
      "");
  auto has = [](const std::string& got, const std::string& want) {
    EXPECT_NE(got.find(want), std::string::npos) << got;
  };
  has(config_error({"parallel.pipeline=8"}, 8),
      "model.n_layer 4 is fewer than the 8 pipeline parts");
  has(config_error({"parallel.pipeline=2", "parallel.schedule=interleaved",
                    "parallel.virtual_stages=2", "train_batch_size=3"},
                   2),
      "the 3 micro-batches (gradient_accumulation_steps) must be a multiple of it");
  has(config_error(
          {"parallel.pipeline=2", "parallel.schedule=interleaved", "parallel.virtual_stages=3"}, 2),
      "model.n_layer 4 does not divide into parallel.pipeline 2 x parallel.virtual_stages 3");
  has(config_error({"parallel.pipeline=2", "parallel.partition=[1,2]"}, 2),
      "parallel.partition sums to 3 layers but model.n_layer is 4");
  has(config_error({"parallel.pipeline=2", "parallel.virtual_stages=2"}, 2),
      "parallel.virtual_stages 2 needs parallel.schedule interleaved");
  has(config_error({"parallel.schedule=interleaved", "parallel.virtual_stages=2"}, 1),
      "parallel.virtual_stages 2 interleaves chunks over pipeline stages; it needs "
      "parallel.pipeline > 1");
  has(config_error({"parallel.pipeline=2", "parallel.schedule=pipedream"}, 2),
      "parallel.schedule: unknown value \"pipedream\"");
  has(config_error({"parallel.pipeline=2", "parallel.partition=even"}, 2),
      "parallel.partition: unknown value \"even\"");
  has(config_error({"parallel.pipeline=2", "parallel.partition=[2,0,2]"}, 2),
      "parallel.partition: 0 is not a layer count");
  Config c = parse_config(R"({"train_batch_size": 8, "data": {"synthetic": true},
                              "model": {"n_layer": 4},
                              "parallel": {"pipeline": 2, "partition": [3, 1]}})",
                          "f.json", {}, 2);
  EXPECT_EQ(c.parallel.partition, "list");
  EXPECT_EQ(c.parallel.partition_counts, (std::vector<int>{3, 1}));
  EXPECT_EQ(c.resolved["parallel"]["partition"], nlohmann::json::array({3, 1}));
}

}  // namespace
}  // namespace loom
