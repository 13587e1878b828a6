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
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/nn/param.h"
#include "loom/parallel/tensor/linear.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "loom/train/whole_model.h"
#include "mpi_main.h"

namespace loom {
namespace {

using test::runtime;

// Every rank's optimizer files go to the same folder (names carry the pid).
std::string nvme_dir() {
  static const std::string dir = [] {
    std::string d = (std::filesystem::temp_directory_path() / "loom-test-nvme").string();
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

struct Layout {
  std::string name;
  std::vector<std::string> overrides;  // on top of the base config
  // Model changes the one-process reference takes too (a deeper model for
  // interleaving over four stages).
  std::vector<std::string> model = {};
};

const char* kBase = R"({
  "train_batch_size": 16,
  "gradient_clipping": 0.5,
  "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 20}},
  "model": {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32, "dropout": 0.1},
  "data": {"synthetic": true},
  "train": {"steps": 20, "seed": 17, "eval_steps": 3},
  "log": {"peak_gflops": 100}
})";

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;  // before clipping; every parameter counted once
  double val_loss = 0;             // over 3 global batches
  std::map<std::string, std::vector<float>> params;  // every parameter, whole, by name
};

// Every parameter of a trainer's model as its whole tensor, by name, on
// every rank (collective: slices are gathered over the tensor-parallel
// group, stages' parameters broadcast over the pipeline), the vocabulary
// without padding.
std::map<std::string, std::vector<float>> whole_params(Trainer& t) {
  return WholeModel(t.engine(), false).params_by_name();
}

RunResult train(const std::vector<std::string>& overrides, std::shared_ptr<ProcessGroup> group) {
  int world = group ? group->size() : 1;
  Config c = parse_config(kBase, "harness", overrides, world);
  RunOptions o;
  o.quiet = true;
  o.parallel = make_parallel_context(std::move(group),
                                     GridShape{world, c.parallel.tensor, c.parallel.pipeline});
  Trainer t(std::move(c), o, ThreadConfig{});
  RunResult r;
  for (const auto& s : t.run()) r.losses.push_back(s.loss), r.grad_norms.push_back(s.grad_norm);
  r.val_loss = t.evaluate();
  // Gathered into whole tensors by name: flat offsets differ between layouts
  // (ZeRO pads every unit to a multiple of the ranks), and tensor
  // parallelism keeps a slice of each split tensor on every rank of its group.
  r.params = whole_params(t);
  return r;
}

std::vector<Layout> layouts(int world) {
  const std::string dp = "parallel.data=" + std::to_string(world);
  std::vector<Layout> tensor = {
      {"tp " + std::to_string(world), {"parallel.tensor=" + std::to_string(world)}},
      {"tp " + std::to_string(world) + " with gradient accumulation 2, selective recompute",
       {"parallel.tensor=" + std::to_string(world), "gradient_accumulation_steps=2",
        "activation_checkpointing.policy=selective"}},
  };
  tensor.push_back(
      {"tp " + std::to_string(world) + ", sequence parallel",
       {"parallel.tensor=" + std::to_string(world), "parallel.sequence_parallel=true"}});
  tensor.push_back(
      {"tp " + std::to_string(world) + ", sequence parallel, accumulation 2, full recompute",
       {"parallel.tensor=" + std::to_string(world), "parallel.sequence_parallel=true",
        "gradient_accumulation_steps=2", "activation_checkpointing.policy=full"}});
  if (world == 4) {
    tensor.push_back(
        {"tp 2 x dp 2, sequence parallel, zero-2",
         {"parallel.tensor=2", "parallel.sequence_parallel=true", "zero_optimization.stage=2"}});
    tensor.push_back({"tp 2 x dp 2", {"parallel.tensor=2", "parallel.data=2"}});
    tensor.push_back({"tp 2 x dp 2, zero-1", {"parallel.tensor=2", "zero_optimization.stage=1"}});
    tensor.push_back({"tp 2 x dp 2, zero-3, full recompute",
                      {"parallel.tensor=2", "zero_optimization.stage=3",
                       "activation_checkpointing.policy=full"}});
  }
  // Pipelines: four micro-batches per step unless said otherwise.
  const std::string acc4 = "gradient_accumulation_steps=4";
  std::vector<Layout> pipeline;
  if (world == 2) {
    for (const char* sched : {"1f1b", "gpipe", "zero_bubble"})
      pipeline.push_back(
          {std::string("pp 2, ") + sched,
           {"parallel.pipeline=2", acc4, std::string("parallel.schedule=") + sched}});
    pipeline.push_back({"pp 2, interleaved v 2",
                        {"parallel.pipeline=2", acc4, "parallel.schedule=interleaved",
                         "parallel.virtual_stages=2"}});
    pipeline.push_back({"pp 2, 1f1b, full recompute, partition [3, 1]",
                        {"parallel.pipeline=2", acc4, "activation_checkpointing.policy=full",
                         "parallel.partition=[3,1]"}});
    pipeline.push_back({"pp 2, zero_bubble, selective recompute",
                        {"parallel.pipeline=2", acc4, "parallel.schedule=zero_bubble",
                         "activation_checkpointing.policy=selective"}});
  }
  if (world == 4) {
    for (const char* sched : {"1f1b", "gpipe", "zero_bubble"})
      pipeline.push_back(
          {std::string("pp 4, ") + sched,
           {"parallel.pipeline=4", acc4, std::string("parallel.schedule=") + sched}});
    pipeline.push_back({"pp 4, interleaved v 2 (8 layers)",
                        {"parallel.pipeline=4", "gradient_accumulation_steps=8",
                         "parallel.schedule=interleaved", "parallel.virtual_stages=2"},
                        {"model.n_layer=8"}});
    pipeline.push_back(
        {"pp 2 x dp 2, zero-1", {"parallel.pipeline=2", acc4, "zero_optimization.stage=1"}});
    pipeline.push_back(
        {"pp 2 x dp 2, zero-2", {"parallel.pipeline=2", acc4, "zero_optimization.stage=2"}});
    pipeline.push_back({"pp 2 x dp 2, zero-3, interleaved v 2",
                        {"parallel.pipeline=2", acc4, "zero_optimization.stage=3",
                         "parallel.schedule=interleaved", "parallel.virtual_stages=2"}});
    pipeline.push_back({"pp 2 x dp 2, zero-3, zero_bubble",
                        {"parallel.pipeline=2", acc4, "zero_optimization.stage=3",
                         "parallel.schedule=zero_bubble"}});
    pipeline.push_back({"pp 2 x tp 2, 1f1b", {"parallel.pipeline=2", "parallel.tensor=2", acc4}});
    pipeline.push_back(
        {"pp 2 x tp 2, sequence parallel, zero_bubble, full recompute",
         {"parallel.pipeline=2", "parallel.tensor=2", acc4, "parallel.sequence_parallel=true",
          "parallel.schedule=zero_bubble", "activation_checkpointing.policy=full"}});
    pipeline.push_back(
        {"pp 4, balanced partition", {"parallel.pipeline=4", acc4, "parallel.partition=balanced"}});
  }
  std::vector<Layout> data = {
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
      {"zero-1, optimizer in nvme files",
       {dp, "zero_optimization.stage=1", "zero_optimization.offload_optimizer.device=nvme",
        "zero_optimization.offload_optimizer.nvme_path=" + nvme_dir()}},
      // Stage 2: a bucket smaller than a layer makes each reduction wait for
      // the previous one; the default lets several overlap.
      {"zero-2, one unit reducing at a time",
       {dp, "zero_optimization.stage=2", "zero_optimization.reduce_bucket_size=20000"}},
      {"zero-2 with gradient accumulation 2",
       {dp, "zero_optimization.stage=2", "gradient_accumulation_steps=2"}},
      {"zero-2, no overlap, optimizer in nvme files",
       {dp, "zero_optimization.stage=2", "zero_optimization.overlap_comm=false",
        "zero_optimization.offload_optimizer.device=nvme",
        "zero_optimization.offload_optimizer.nvme_path=" + nvme_dir()}},
      // Stage 3: no unit resident, one unit prefetched; then everything
      // prefetched with the final norm resident; then no prefetch at all.
      {"zero-3, prefetch one unit, nothing resident",
       {dp, "zero_optimization.stage=3", "zero_optimization.stage3_prefetch_bucket_size=1",
        "zero_optimization.stage3_param_persistence_threshold=0"}},
      {"zero-3 with gradient accumulation 2",
       {dp, "zero_optimization.stage=3", "gradient_accumulation_steps=2",
        "zero_optimization.stage3_prefetch_bucket_size=100000000"}},
      {"zero-3, gather on use, accumulation 2, ring",
       {dp, "zero_optimization.stage=3", "zero_optimization.stage3_prefetch_bucket_size=0",
        "gradient_accumulation_steps=2", "comm.allreduce=ring"}},
  };
  data.insert(data.end(), tensor.begin(), tensor.end());
  data.insert(data.end(), pipeline.begin(), pipeline.end());
  return data;
}

void expect_like_one_process(const Layout& layout) {
  // One process, micro-batch 16 (the reference of each model, kept).
  static std::map<std::vector<std::string>, RunResult> refs;
  if (!refs.count(layout.model)) refs[layout.model] = train(layout.model, nullptr);
  const RunResult& ref = refs[layout.model];
  ASSERT_EQ(ref.losses.size(), 20u);
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  {
    CommOptions opt;
    opt.timeout_s = 120;
    for (const auto& o : layout.overrides)
      if (o.rfind("comm.allreduce=", 0) == 0) opt.allreduce = o.substr(15);
    std::vector<std::string> overrides = layout.model;
    overrides.insert(overrides.end(), layout.overrides.begin(), layout.overrides.end());
    RunResult got = train(overrides, runtime().world(opt));
    ASSERT_EQ(got.losses.size(), ref.losses.size()) << layout.name;
    for (size_t s = 0; s < ref.losses.size(); ++s)
      EXPECT_LE(std::abs(got.losses[s] - ref.losses[s]), 1e-5 * std::abs(ref.losses[s]))
          << layout.name << ", step " << s + 1 << ": " << got.losses[s] << " vs " << ref.losses[s];
    for (size_t s = 0; s < ref.grad_norms.size(); ++s)
      EXPECT_LE(std::abs(got.grad_norms[s] - ref.grad_norms[s]), 1e-4 * ref.grad_norms[s])
          << layout.name << ", step " << s + 1 << ": grad norm " << got.grad_norms[s] << " vs "
          << ref.grad_norms[s];
    EXPECT_LE(std::abs(got.val_loss - ref.val_loss), 1e-5 * ref.val_loss)
        << layout.name << ": validation loss " << got.val_loss << " vs " << ref.val_loss;
    double maxdiff = 0;
    ASSERT_EQ(got.params.size(), ref.params.size()) << layout.name;
    for (const auto& [name, want] : ref.params) {
      const std::vector<float>& have = got.params.at(name);
      ASSERT_EQ(have.size(), want.size()) << layout.name << ": " << name;
      for (size_t i = 0; i < want.size(); ++i)
        maxdiff = std::max(maxdiff, double(std::abs(have[i] - want[i])));
    }
    EXPECT_LE(maxdiff, 1e-4) << layout.name;
    if (runtime().world_rank() == 0)
      std::printf("[ layout ] %-48s world %d: max |param diff| %.2e, final loss %.6f (ref %.6f)\n",
                  layout.name.c_str(), runtime().world_size(), maxdiff, got.losses.back(),
                  ref.losses.back());
  }
}

TEST(Layouts, TrainExactlyLikeOneProcess) {
  for (const Layout& layout : layouts(runtime().world_size())) expect_like_one_process(layout);
}

// Eight ranks: every kind of model parallelism with data parallelism.
TEST(Layouts8, PipelineTensorDataTrainLikeOneProcess) {
  if (runtime().world_size() != 8) GTEST_SKIP() << "needs 8 ranks";
  expect_like_one_process({"pp 2 x tp 2 x dp 2, 1f1b, zero-1",
                           {"parallel.pipeline=2", "parallel.tensor=2",
                            "gradient_accumulation_steps=2", "zero_optimization.stage=1"}});
}

// Activation checkpointing recomputes in backward what forward computed, with
// the same kernels on the same inputs and the same dropout masks: every
// policy trains bitwise like keeping everything, at every ZeRO stage (stage 3
// gathers a unit again for its recompute pass).
TEST(Checkpointing, PoliciesTrainBitwiseLikeNoneAtEveryZeroStage) {
  const int n = runtime().world_size();
  const std::string dp = "parallel.data=" + std::to_string(n);
  // A budget that keeps two of the four blocks whole.
  Config probe_config = parse_config(kBase, "harness", {dp}, n);
  GptStage<float> probe(probe_config.model);
  const int64_t B = probe_config.micro_batch, T = probe_config.model.seq_len;
  CheckpointPolicy full;
  full.kind = CheckpointPolicy::kFull;
  probe.set_plan(probe.plan(full, B, T));
  const size_t budget =
      probe.store_bytes(B, T) + probe.room_bytes(B, T) +
      2 * (probe.block_bytes(B, T, Recompute::kNone) - probe.block_bytes(B, T, Recompute::kFull));
  for (int stage : {0, 1, 2, 3}) {
    auto run = [&](std::vector<std::string> policy) {
      policy.insert(policy.end(), {dp, "train.steps=10", "gradient_accumulation_steps=2",
                                   "zero_optimization.stage=" + std::to_string(stage),
                                   "zero_optimization.stage3_param_persistence_threshold=0"});
      return train(policy, runtime().world(CommOptions{}));
    };
    const RunResult ref = run({"activation_checkpointing.policy=none"});
    const std::vector<std::vector<std::string>> policies = {
        {"activation_checkpointing.policy=full"},
        {"activation_checkpointing.policy=selective"},
        {"activation_checkpointing.policy=every_n", "activation_checkpointing.every_n=3"},
        {"activation_checkpointing.policy=budget",
         "activation_checkpointing.budget_bytes=" + std::to_string(budget)}};
    for (const auto& policy : policies) {
      const RunResult got = run(policy);
      EXPECT_EQ(got.losses, ref.losses) << policy[0] << " at stage " << stage;
      EXPECT_EQ(got.val_loss, ref.val_loss) << policy[0] << " at stage " << stage;
      EXPECT_TRUE(got.params == ref.params) << policy[0] << " at stage " << stage;
    }
    if (runtime().world_rank() == 0)
      std::printf(
          "[ recompute ] stage %d world %d: none, full, selective, every_n, budget "
          "bitwise equal over %zu steps (final loss %.6f)\n",
          stage, n, ref.losses.size(), ref.losses.back());
  }
}

// Checkpoints hold whole tensors, so one saved under any tensor-parallel
// size loads under any other: parameters and AdamW moments come back
// bitwise. tp N -> one process -> tp N, and at 4 ranks tp 4 -> tp 2 -> tp 4.
TEST(TensorParallel, CheckpointsLoadUnderAnyTensorParallelSizeBitwise) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-tp-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  struct Local {
    std::vector<float> params, m, v;
  };
  auto make = [&](int tp, const std::string& resume, const std::string& dir, bool one_process) {
    Config c = parse_config(kBase, "harness",
                            {"parallel.tensor=" + std::to_string(tp), "train.steps=3",
                             "checkpoint.every=3", "checkpoint.dir=" + root + "/" + dir},
                            one_process ? 1 : n);
    RunOptions o;
    o.quiet = true;
    o.resume = resume;
    if (!one_process) o.parallel = make_parallel_context(world, GridShape{n, tp});
    return std::make_unique<Trainer>(std::move(c), o, ThreadConfig{});
  };
  auto local = [](Trainer& t) {
    Local l;
    l.params = t.gather_params();
    t.zero().gather_moments(l.m, l.v);
    return l;
  };
  const std::string step = "/step-00000003";
  // A: trained at tp n, saved.
  auto a = make(n, "", "a", false);
  a->run();
  const Local la = local(*a);
  const auto whole_a = whole_params(*a);
  // B: every rank loads it in one process; rank 0 saves it again from there.
  auto b = make(1, root + "/a" + step, "b", true);
  EXPECT_TRUE(whole_params(*b) == whole_a) << "tp " << n << " -> one process";
  if (world->rank() == 0) b->save(0.0);
  world->barrier()->wait();
  // C: tp n from the one-process checkpoint: the same slices and moments as A.
  auto c = make(n, root + "/b" + step, "c", false);
  const Local lc = local(*c);
  EXPECT_TRUE(lc.params == la.params) << "one process -> tp " << n;
  EXPECT_TRUE(lc.m == la.m && lc.v == la.v) << "moments, one process -> tp " << n;
  if (n == 4) {
    // D: tp 2 (x dp 2) from A's tp-4 checkpoint, saved; E: tp 4 from that.
    auto d = make(2, root + "/a" + step, "d", false);
    EXPECT_TRUE(whole_params(*d) == whole_a) << "tp 4 -> tp 2";
    d->save(0.0);
    auto e = make(4, root + "/d" + step, "e", false);
    const Local le = local(*e);
    EXPECT_TRUE(le.params == la.params) << "tp 2 -> tp 4";
    EXPECT_TRUE(le.m == la.m && le.v == la.v) << "moments, tp 2 -> tp 4";
  }
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf("[ tp checkpoints ] world %d: tp %d -> 1 -> %d%s bitwise\n", n, n, n,
                n == 4 ? ", 4 -> 2 -> 4" : "");
  }
}

// Checkpoints of a pipelined run hold whole tensors too: they load in one
// process and at another pipeline size with parameters and AdamW moments
// bitwise, and a pipelined run resumed from one continues bitwise as if
// never stopped.
TEST(Pipeline, CheckpointsLoadAnywhereAndResumeBitwise) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-pp-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  using State = std::map<std::string, std::vector<float>>;
  // Parameters and both moments of every tensor, whole, by name.
  auto state = [](Trainer& t) {
    WholeModel w(t.engine(), true);
    State out;
    for (const Param& p : w.layout().params())
      for (auto [kind, prefix] :
           {std::pair{WholeModel::kParam, ""}, std::pair{WholeModel::kExpAvg, "exp_avg."},
            std::pair{WholeModel::kExpAvgSq, "exp_avg_sq."}}) {
        std::vector<float> x(static_cast<size_t>(p.shape.numel()));
        w.get(p, kind, x.data());
        out[prefix + p.name] = std::move(x);
      }
    return out;
  };
  auto make = [&](int pp, int steps, const std::string& resume, const std::string& dir,
                  bool one_process) {
    const int world_size = one_process ? 1 : n;
    Config c =
        parse_config(kBase, "harness",
                     {"parallel.pipeline=" + std::to_string(pp), "gradient_accumulation_steps=4",
                      "train.steps=" + std::to_string(steps), "checkpoint.every=3",
                      "checkpoint.dir=" + root + "/" + dir},
                     world_size);
    RunOptions o;
    o.quiet = true;
    o.resume = resume;
    if (!one_process) o.parallel = make_parallel_context(world, GridShape{n, 1, pp});
    return std::make_unique<Trainer>(std::move(c), o, ThreadConfig{});
  };
  const std::string step = "/step-00000003";
  // A: pp n, 3 steps, saved.
  auto a = make(n, 3, "", "a", false);
  a->run();
  const State sa = state(*a);
  // B: one process loads it (every rank); rank 0 saves it again from there.
  auto b = make(1, 3, root + "/a" + step, "b", true);
  EXPECT_TRUE(state(*b) == sa) << "pp " << n << " -> one process";
  if (world->rank() == 0) b->save(0.0);
  world->barrier()->wait();
  // C: pp n from the one-process checkpoint.
  auto c = make(n, 3, root + "/b" + step, "c", false);
  EXPECT_TRUE(state(*c) == sa) << "one process -> pp " << n;
  if (n == 4) {
    // D: pp 2 x dp 2 from A's pp-4 checkpoint, saved; E: pp 4 from that.
    auto d = make(2, 3, root + "/a" + step, "d", false);
    EXPECT_TRUE(state(*d) == sa) << "pp 4 -> pp 2 x dp 2";
    d->save(0.0);
    auto e = make(4, 3, root + "/d" + step, "e", false);
    EXPECT_TRUE(state(*e) == sa) << "pp 2 -> pp 4";
  }
  // F: 6 steps straight; G: A's checkpoint resumed for steps 4-6.
  auto f = make(n, 6, "", "f", false);
  const std::vector<StepResult> rf = f->run();
  auto g = make(n, 6, root + "/a" + step, "g", false);
  const std::vector<StepResult> rg = g->run();
  ASSERT_EQ(rg.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(rg[k].loss, rf[k + 3].loss) << "step " << k + 4;
  EXPECT_TRUE(state(*g) == state(*f)) << "resumed run's final state";
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf("[ pp checkpoints ] world %d: pp %d -> 1 -> %d%s bitwise; resume bitwise\n", n, n,
                n, n == 4 ? ", 4 -> 2 x dp 2 -> 4" : "");
  }
}

// Column- and row-parallel linears against the same layers in one process:
// y = x W1 + b1 column-parallel with the output gathered, z = y W2 + b2
// row-parallel on this rank's columns of y; forward values and every
// gradient (the input's after its all-reduce) match.
TEST(TensorParallel, ColumnAndRowParallelLinearsMatchOneProcess) {
  auto world = runtime().world(CommOptions{});
  constexpr int64_t N = 5, in = 8, hidden = 12;
  struct Net {
    ParamStore<float> ps;
    std::unique_ptr<tp::ColumnParallelLinear> col;
    std::unique_ptr<tp::RowParallelLinear> row;
    Net(const tp::Group& g, int64_t in, int64_t hidden) {
      ParamLayout layout;
      layout.begin_unit("u");
      col = std::make_unique<tp::ColumnParallelLinear>(layout, "fc", in, hidden, 0.5f, g);
      row = std::make_unique<tp::RowParallelLinear>(layout, "proj", hidden, in, 0.5f, g);
      ps.build(std::move(layout), StoreOptions{});
      ps.init(3);
      // Biases start at zero; give them values (by global index) to check.
      for (const Param& p : ps.layout().params())
        if (p.shape.rank() == 1)
          for (int64_t i = 0; i < p.numel; ++i)
            ps.param(p)[i] = 0.1f * float(shard_global_index(p.shape, p.shard, i) + 1);
      ps.zero_grads();
    }
  };
  std::vector<float> x(N * in), dz(N * in);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * i), dz[i] = std::cos(0.3f * i);
  auto run = [&](Net& net, const tp::Group& g, std::vector<float>& y, std::vector<float>& z,
                 std::vector<float>& dx) {
    y.assign(N * hidden, 0), z.assign(N * in, 0), dx.assign(N * in, 0);
    net.col->forward_gathered(net.ps, y.data(), x.data(), N);
    std::vector<float> y_mine(N * hidden / g.size()), dy_mine(y_mine.size(), 0), dy(N * hidden);
    shard_from_global(Shape{N, hidden}, ShardSpec::split(1, g.rank(), g.size()), y.data(),
                      y_mine.data());
    net.row->forward(net.ps, z.data(), y_mine.data(), N);
    net.row->backward(net.ps, dy_mine.data(), dz.data(), y_mine.data(), N);
    std::vector<float> all(N * hidden);
    g.gather(dy_mine.data(), all.data(), static_cast<int64_t>(dy_mine.size()));
    for (int r = 0; r < g.size(); ++r)
      shard_to_global(Shape{N, hidden}, ShardSpec::split(1, r, g.size()),
                      all.data() + r * dy_mine.size(), dy.data());
    net.col->backward_gathered(net.ps, dx.data(), dy.data(), x.data(), N);
    tp::copy_to_region_backward(g, dx.data(), N * in);
  };
  tp::Group one(nullptr), group(world);
  Net serial(one, in, hidden), split(group, in, hidden);
  std::vector<float> y1, z1, dx1, y2, z2, dx2;
  run(serial, one, y1, z1, dx1);
  run(split, group, y2, z2, dx2);
  auto near = [](const std::vector<float>& a, const std::vector<float>& b) {
    double d = 0;
    for (size_t i = 0; i < a.size(); ++i) d = std::max(d, double(std::abs(a[i] - b[i])));
    return d;
  };
  EXPECT_LE(near(y1, y2), 1e-5);
  EXPECT_LE(near(z1, z2), 1e-5);
  EXPECT_LE(near(dx1, dx2), 1e-5);
  // Every gradient slice is the serial gradient's slice.
  for (const Param& p : split.ps.layout().params()) {
    const Param& whole = serial.ps.layout().find(p.name);
    std::vector<float> want(static_cast<size_t>(p.numel));
    shard_from_global(p.shape, p.shard, serial.ps.grad(whole), want.data());
    std::vector<float> got(split.ps.grad(p), split.ps.grad(p) + p.numel);
    EXPECT_LE(near(got, want), 1e-5) << p.name;
  }
}

size_t current(MemCategory c) {
  return memory_tracker().stats().current[static_cast<int>(c)];
}
size_t peak(MemCategory c) {
  return memory_tracker().stats().peak[static_cast<int>(c)];
}

// Model-state bytes per rank against the ZeRO formulas for f32 AdamW (P: the
// elements of the flat buffers, which every stage pads to split evenly), and
// the buffers stages 2-3 add during a step bounded by their settings.
TEST(Zero, ModelStateBytesFollowTheFormulas) {
  const int n = runtime().world_size();
  for (int stage : {0, 1, 2, 3}) {
    const size_t p0 = current(MemCategory::kParams), g0 = current(MemCategory::kGrads),
                 o0 = current(MemCategory::kOptimizer), c0 = current(MemCategory::kComm);
    // Eight layers, one unit prefetched, one reduced at a time, none resident.
    Config c = parse_config(kBase, "harness",
                            {"parallel.data=" + std::to_string(n), "model.n_layer=8",
                             "zero_optimization.stage=" + std::to_string(stage),
                             "zero_optimization.reduce_bucket_size=1",
                             "zero_optimization.stage3_prefetch_bucket_size=1",
                             "zero_optimization.stage3_param_persistence_threshold=0"},
                            n);
    RunOptions o;
    o.quiet = true;
    o.parallel = make_parallel_context(runtime().world(CommOptions{}), GridShape{});
    Trainer t(std::move(c), o, ThreadConfig{});
    const double P = double(t.model().num_params());
    const double params = double(current(MemCategory::kParams) - p0);
    const double grads = double(current(MemCategory::kGrads) - g0);
    const double optim = double(current(MemCategory::kOptimizer) - o0);
    const double want[4][3] = {{4 * P, 4 * P, 8 * P},
                               {4 * P, 4 * P, 8 * P / n},
                               {4 * P, 4 * P / n, 8 * P / n},
                               {4 * P / n, 4 * P / n, 8 * P / n}};
    EXPECT_EQ(params, want[stage][0]) << "stage " << stage;
    EXPECT_EQ(grads, want[stage][1]) << "stage " << stage;
    EXPECT_EQ(optim, want[stage][2]) << "stage " << stage;
    const double formula[4] = {16 * P, 8 * P + 8 * P / n, 4 * P + 12 * P / n, 16 * P / n};
    EXPECT_LE(std::abs(params + grads + optim - formula[stage]), 0.05 * formula[stage]);

    t.train_step();
    int64_t max_unit = 0;
    for (const Unit& u : t.model().layout().units()) max_unit = std::max(max_unit, u.size());
    const double comm = double(peak(MemCategory::kComm) - c0), unit_bytes = 4.0 * double(max_unit);
    if (stage == 3) {
      EXPECT_LE(t.zero().max_gathered_elements(), size_t(2 * max_unit));
    }
    // Stage 2: the unit backward writes, the previous unit still being
    // reduced, and the reduce-scatter's result slice (1/n of a unit). Stage 3
    // adds the unit in use and the one prefetched.
    if (stage == 2) {
      EXPECT_LE(comm, (2.0 + 1.0 / n) * unit_bytes);
    } else if (stage == 3) {
      EXPECT_LE(comm, (4.0 + 1.0 / n) * unit_bytes);
    }
    if (stage >= 2) {
      EXPECT_LT(comm, 4 * P) << "buffers must stay below full gradients";
    }
    if (runtime().world_rank() == 0)
      std::printf(
          "[ memory ] stage %d N %d: params %.0f grads %.0f optimizer %.0f (formula %.0f), "
          "comm peak %.0f (%.2f units)\n",
          stage, n, params, grads, optim, formula[stage], comm, comm / unit_bytes);
  }
}

// offload_optimizer nvme: the moments live in a file; after a step none of
// them stays resident in the process, and during one at most a unit's.
TEST(Zero, NvmeOffloadKeepsTheMomentsOutOfMemory) {
  const int n = runtime().world_size();
  for (int stage : {1, 3}) {
    const size_t o0 = current(MemCategory::kOptimizer);
    Config c = parse_config(kBase, "harness",
                            {"parallel.data=" + std::to_string(n), "model.n_layer=8",
                             "zero_optimization.stage=" + std::to_string(stage),
                             "zero_optimization.offload_optimizer.device=nvme",
                             "zero_optimization.offload_optimizer.nvme_path=" + nvme_dir()},
                            n);
    RunOptions o;
    o.quiet = true;
    o.parallel = make_parallel_context(runtime().world(CommOptions{}), GridShape{});
    Trainer t(std::move(c), o, ThreadConfig{});
    EXPECT_EQ(current(MemCategory::kOptimizer), o0) << "stage " << stage;
    t.train_step();
    t.train_step();
    int64_t max_unit = 0;
    for (const Unit& u : t.model().layout().units()) max_unit = std::max(max_unit, u.size());
    const double unit_moments = 2.0 * 4.0 * double(max_unit) / n;
    EXPECT_LE(double(peak(MemCategory::kOptimizer) - o0), unit_moments);
    const size_t resident = t.zero().optimizer_resident_bytes();
    EXPECT_EQ(resident, 0u) << "stage " << stage;
    if (runtime().world_rank() == 0)
      std::printf(
          "[ nvme   ] stage %d N %d: moments %.0f bytes in the file, resident after a step "
          "%zu, peak during it %.0f\n",
          stage, n, 8.0 * double(t.zero().shard_elements()), resident,
          double(peak(MemCategory::kOptimizer) - o0));
  }
}

}  // namespace
}  // namespace loom
