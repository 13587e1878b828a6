// The layout-equivalence harness: the same small GPT trained for 20 steps
// under a parallel layout and in one process, from the same seed and data;
// per-step losses and every final parameter compared. Every parallel strategy
// adds its layouts to the table below.
//
// Tolerances, from reduction order alone (all arithmetic is f32): the layouts
// sum the same per-sample gradients in another order (per rank, then across
// ranks), which moves each gradient by a few ulps; AdamW's normalisation keeps
// that from growing over 20 steps. Loss: relative difference <= 1e-5 per step.
// Parameters: maximum absolute difference <= 1e-4 (weights are O(0.02-1)).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "mpi_main.h"

namespace loom {
namespace {

using test::runtime;

struct Layout {
  std::string name;
  std::vector<std::string> overrides;  // on top of the base config
};

const char* kBase = R"({
  "train_batch_size": 16,
  "gradient_clipping": 0.5,
  "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 20}},
  "model": {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32, "dropout": 0.1},
  "data": {"synthetic": true},
  "train": {"steps": 20, "seed": 17},
  "log": {"peak_gflops": 100}
})";

struct RunResult {
  std::vector<double> losses;
  std::vector<float> params;
};

RunResult train(const std::vector<std::string>& overrides, std::shared_ptr<ProcessGroup> group) {
  int world = group ? group->size() : 1;
  Config c = parse_config(kBase, "harness", overrides, world);
  RunOptions o;
  o.quiet = true;
  o.dp_group = std::move(group);
  Trainer t(std::move(c), o, ThreadConfig{});
  RunResult r;
  for (const auto& s : t.run()) r.losses.push_back(s.loss);
  r.params.assign(t.model().params(), t.model().params() + t.model().num_params());
  return r;
}

std::vector<Layout> layouts(int world) {
  const std::string dp = "parallel.data=" + std::to_string(world);
  return {
      {"dp, one bucket per layer or so, overlapped",
       {dp, "zero_optimization.reduce_bucket_size=20000"}},
      {"dp, one bucket, after backward",
       {dp, "zero_optimization.reduce_bucket_size=1000000000",
        "zero_optimization.overlap_comm=false"}},
      {"dp with gradient accumulation 2",
       {dp, "gradient_accumulation_steps=2", "zero_optimization.reduce_bucket_size=50000"}},
      {"dp, ring all-reduce",
       {dp, "comm.allreduce=ring", "zero_optimization.reduce_bucket_size=30000"}},
      {"zero-1, overlapped buckets",
       {dp, "zero_optimization.stage=1", "zero_optimization.reduce_bucket_size=20000"}},
      {"zero-1 with gradient accumulation 2",
       {dp, "zero_optimization.stage=1", "gradient_accumulation_steps=2"}},
  };
}

TEST(Layouts, TrainExactlyLikeOneProcess) {
  const RunResult ref = train({}, nullptr);  // one process, micro-batch 16
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (const Layout& layout : layouts(runtime().world_size())) {
    CommOptions opt;
    opt.timeout_s = 120;
    for (const auto& o : layout.overrides)
      if (o.rfind("comm.allreduce=", 0) == 0) opt.allreduce = o.substr(15);
    RunResult got = train(layout.overrides, runtime().world(opt));
    ASSERT_EQ(got.losses.size(), ref.losses.size()) << layout.name;
    for (size_t s = 0; s < ref.losses.size(); ++s)
      EXPECT_LE(std::abs(got.losses[s] - ref.losses[s]), 1e-5 * std::abs(ref.losses[s]))
          << layout.name << ", step " << s + 1 << ": " << got.losses[s] << " vs " << ref.losses[s];
    double maxdiff = 0;
    for (size_t i = 0; i < ref.params.size(); ++i)
      maxdiff = std::max(maxdiff, double(std::abs(got.params[i] - ref.params[i])));
    EXPECT_LE(maxdiff, 1e-4) << layout.name;
    if (runtime().world_rank() == 0)
      std::printf("[ layout ] %-48s world %d: max |param diff| %.2e, final loss %.6f (ref %.6f)\n",
                  layout.name.c_str(), runtime().world_size(), maxdiff, got.losses.back(),
                  ref.losses.back());
  }
}

TEST(Zero, Stage1KeepsOneShardOfTheOptimizerState) {
  const int n = runtime().world_size();
  auto optimizer_bytes = [] {
    return memory_tracker().stats().current[static_cast<int>(MemCategory::kOptimizer)];
  };
  for (int stage : {0, 1}) {
    size_t before = optimizer_bytes();
    Config c = parse_config(
        kBase, "harness",
        {"parallel.data=" + std::to_string(n), "zero_optimization.stage=" + std::to_string(stage)},
        n);
    RunOptions o;
    o.quiet = true;
    o.dp_group = runtime().world(CommOptions{});
    Trainer t(std::move(c), o, ThreadConfig{});
    const double held = double(optimizer_bytes() - before);
    // f32 AdamW: 8 bytes per parameter, divided by the ranks at stage 1 (the
    // flat buffer is padded to a multiple of n, so allow a few elements).
    const double params = double(t.model().num_params());
    const double want = stage == 0 ? 8 * params : 8 * params / n;
    EXPECT_NEAR(held, want, 8.0 * n) << "stage " << stage;
  }
}

}  // namespace
}  // namespace loom
