// loom launch without processes: host lists, the layout a restart fits to
// the slots that remain, and the straggler scores.
#include <gtest/gtest.h>

#include "loom/core/error.h"
#include "loom/train/launch.h"
#include "loom/train/straggler.h"

namespace loom {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Launch, HostsParseAndPrintBack) {
  auto h = parse_hosts("node0:2,node1,10.0.0.7:4");
  ASSERT_EQ(h.size(), 3u);
  EXPECT_EQ(h[1].name, "node1");
  EXPECT_EQ(h[1].slots, 1);
  EXPECT_EQ(total_slots(h), 7);
  EXPECT_EQ(hosts_arg(h), "node0:2,node1:1,10.0.0.7:4");
  EXPECT_NE(error_of([] { parse_hosts("node0:2,node0:1"); }).find("host node0 is listed twice"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hosts("node0:0"); }).find("'node0:0' has slots '0'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_hosts("node0:2,"); }).find("empty host name"), std::string::npos);
  EXPECT_NE(error_of([] { parse_hosts("node0:x"); }).find("has slots 'x'"), std::string::npos);
}

TEST(Launch, RestartKeepsTheGlobalBatchAndRaisesAccumulation) {
  // 4 ranks of dp with micro-batch 2 and batch 16 (accumulation 2); 2 remain.
  BatchLayout b{16, 2, 1, 1, 1};
  auto four = fit_layout(b, 4);
  ASSERT_TRUE(four);
  EXPECT_EQ(four->world, 4);
  EXPECT_EQ(four->accumulation, 2);
  auto two = fit_layout(b, 2);
  ASSERT_TRUE(two);
  EXPECT_EQ(two->dp, 2);
  EXPECT_EQ(two->accumulation, 4);
  // 3 slots: dp 3 does not divide 16 / 2; the restart runs on 2.
  EXPECT_EQ(fit_layout(b, 3)->world, 2);
  // tp 2 x pp 2 needs multiples of 4; 6 slots give 4.
  BatchLayout mp{16, 2, 2, 2, 1};
  EXPECT_EQ(fit_layout(mp, 6)->world, 4);
  EXPECT_FALSE(fit_layout(mp, 3));
  // Expert parallelism 2 needs an even dp.
  BatchLayout ep{12, 1, 1, 1, 2};
  EXPECT_EQ(fit_layout(ep, 5)->world, 4);
  // Interleaved over pp 2: the accumulation stays a multiple of 2 (batch
  // 12, micro 2: dp 3 would give accumulation 2, dp 6 gives 1 and is out).
  BatchLayout il{12, 2, 1, 2, 1, true};
  EXPECT_EQ(fit_layout(il, 12)->world, 6);
  EXPECT_EQ(fit_layout(il, 12)->accumulation, 2);
  // Context parallel 2 x tp 2: multiples of 4; batch 8 with micro 2 at dp 1
  // is accumulation 4; experts 4 come out of dp x cp = 4.
  BatchLayout cp{8, 2, 2, 1, 4, false, 2};
  EXPECT_FALSE(fit_layout(cp, 7));  // dp 1 x cp 2 = 2 ranks hold no 4 experts' groups
  BatchLayout cp2{8, 2, 2, 1, 2, false, 2};
  EXPECT_EQ(fit_layout(cp2, 7)->world, 4);
  EXPECT_EQ(fit_layout(cp2, 7)->accumulation, 4);
  EXPECT_EQ(fit_layout(cp2, 9)->world, 8);
  EXPECT_EQ(fit_layout(cp2, 9)->dp, 2);
}

TEST(Stragglers, ASlowRankScoresBelowTheThresholdAndRecoversWithHysteresis) {
  StragglerDetector d(4, {}, 5, 0.8);
  for (int s = 0; s < 4; ++s) d.add({1.0, 1.0, 1.0, 2.0});
  EXPECT_TRUE(d.slow().empty());  // the window is not full yet
  d.add({1.0, 1.02, 0.98, 2.0});
  EXPECT_NEAR(d.scores()[3], 0.5, 1e-9);
  EXPECT_DOUBLE_EQ(d.scores()[0], 1.0);
  EXPECT_EQ(d.slow(), (std::vector<int>{3}));
  // One fast step does not clear it (the median of the window).
  d.add({1.0, 1.0, 1.0, 1.0});
  EXPECT_EQ(d.slow(), (std::vector<int>{3}));
  // Back to 1.15x the median: score 0.87, above 0.8 but within the hysteresis.
  for (int s = 0; s < 5; ++s) d.add({1.0, 1.0, 1.0, 1.15});
  EXPECT_EQ(d.slow(), (std::vector<int>{3}));
  for (int s = 0; s < 5; ++s) d.add({1.0, 1.0, 1.0, 1.05});
  EXPECT_TRUE(d.slow().empty());
  // Noise of a few percent is never a straggler.
  StragglerDetector n(3, {}, 5, 0.8);
  for (int s = 0; s < 20; ++s) n.add({1.0 + 0.05 * (s % 3), 1.0, 1.05});
  EXPECT_TRUE(n.slow().empty());
  // Peers are the ranks of the same stage: a last stage that computes
  // twice as long as the first, by design, is no straggler; one slow rank
  // among its stage's peers is.
  StragglerDetector pp(4, {0, 0, 1, 1}, 3, 0.8);
  for (int s = 0; s < 3; ++s) pp.add({1.0, 1.0, 2.0, 2.0});
  EXPECT_TRUE(pp.slow().empty());
  for (int s = 0; s < 3; ++s) pp.add({1.0, 1.0, 2.0, 4.0});
  EXPECT_EQ(pp.slow(), (std::vector<int>{3}));
}

}  // namespace
}  // namespace loom
