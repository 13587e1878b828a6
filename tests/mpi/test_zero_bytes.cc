// What each rank holds and sends under mpirun: the tensor-parallel linears
// against one process, ZeRO's model-state bytes, 16-bit checkpoints, the
// bytes 16-bit runs send (parameters, gradients, activation payloads) and
// the nvme offload's residency.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "loom/checkpoint/sharded.h"
#include "loom/core/memory.h"
#include "loom/io/fs.h"
#include "loom/nn/param.h"
#include "loom/parallel/expert/all_to_all.h"
#include "loom/parallel/tensor/linear.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "loom/train/whole_model.h"
#include "mpi_main.h"

namespace loom {
namespace {

using test::runtime;
using namespace test;

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

// Model-state bytes per rank against the ZeRO formulas for AdamW (P: the
// elements of the flat buffers, which every stage pads to split evenly): in
// f32, 4 + 4 + 8 bytes per parameter; in bf16, 2 + 2 + 12 (the masters join
// the moments: the ZeRO paper's K = 12). And the buffers stages 2-3 add
// during a step bounded by their settings.
TEST(Zero, ModelStateBytesFollowTheFormulas) {
  const int n = runtime().world_size();
  for (const bool half : {false, true})
    for (int stage : {0, 1, 2, 3}) {
      const size_t p0 = current(MemCategory::kParams), g0 = current(MemCategory::kGrads),
                   o0 = current(MemCategory::kOptimizer), c0 = current(MemCategory::kComm);
      // Eight layers, one unit prefetched, one reduced at a time, none resident.
      Config c = parse_config(kBase, "harness",
                              {"parallel.data=" + std::to_string(n), "model.n_layer=8",
                               "zero_optimization.stage=" + std::to_string(stage),
                               "zero_optimization.reduce_bucket_size=1",
                               "zero_optimization.stage3_prefetch_bucket_size=1",
                               "zero_optimization.stage3_param_persistence_threshold=0",
                               std::string("bf16.enabled=") + (half ? "true" : "false")},
                              n);
      RunOptions o;
      o.quiet = true;
      o.parallel = make_parallel_context(runtime().world(CommOptions{}), GridShape{});
      Trainer t(std::move(c), o, ThreadConfig{});
      const double P = double(t.model().num_params());
      const double params = double(current(MemCategory::kParams) - p0);
      const double grads = double(current(MemCategory::kGrads) - g0);
      const double optim = double(current(MemCategory::kOptimizer) - o0);
      const double w = half ? 2 : 4, k = half ? 12 : 8;  // bytes of a parameter; optimizer's
      const double want[4][3] = {{w * P, w * P, k * P},
                                 {w * P, w * P, k * P / n},
                                 {w * P, w * P / n, k * P / n},
                                 {w * P / n, w * P / n, k * P / n}};
      const char* name = half ? "bf16" : "f32";
      EXPECT_EQ(params, want[stage][0]) << name << " stage " << stage;
      EXPECT_EQ(grads, want[stage][1]) << name << " stage " << stage;
      EXPECT_EQ(optim, want[stage][2]) << name << " stage " << stage;
      const double formula[4] = {(2 * w + k) * P, 2 * w * P + k * P / n, w * P + (w + k) * P / n,
                                 (2 * w + k) * P / n};
      EXPECT_LE(std::abs(params + grads + optim - formula[stage]), 0.05 * formula[stage]);

      t.train_step();
      int64_t max_unit = 0;
      for (const Unit& u : t.model().layout().units()) max_unit = std::max(max_unit, u.size());
      const double comm = double(peak(MemCategory::kComm) - c0),
                   unit_bytes = 4.0 * double(max_unit);
      if (stage == 3) {
        EXPECT_LE(t.zero().max_gathered_elements(), size_t(2 * max_unit));
      }
      // f32, stage 2: the unit backward writes, the previous unit still
      // being reduced, and the reduce-scatter's result slice (1/n of a
      // unit). Stage 3 adds the unit in use and the one prefetched. bf16
      // adds at every stage the f32 copy of the unit in use and its f32
      // gradients while backward writes them, and the transport widens a
      // 16-bit reduction's input to f32 to accumulate it (one unit more at
      // stages 2-3; a bucket at 0-1) on the communication thread, whose
      // conversions overlap the main thread's buffers as the timing falls;
      // gathered and reduced units are half the size. (Measured on rank 0:
      // 2.0-2.3 units at stages 0-1, 4.0-4.5 at 2, 4.5-5.0 at 3; the bounds
      // leave a unit for the timing.)
      if (!half && stage == 2) {
        EXPECT_LE(comm, (2.0 + 1.0 / n) * unit_bytes);
      } else if (!half && stage == 3) {
        EXPECT_LE(comm, (4.0 + 1.0 / n) * unit_bytes);
      } else if (half) {
        EXPECT_LE(comm, (stage < 2    ? 3.5
                         : stage == 2 ? 5.0 + 1.0 / n
                                      : 6.0 + 1.0 / n) *
                            unit_bytes)
            << name << " stage " << stage;
      }
      if (stage >= 2 && !half) {
        EXPECT_LT(comm, w * P) << "buffers must stay below full gradients";
      }
      if (runtime().world_rank() == 0)
        std::printf(
            "[ memory ] %s stage %d N %d: params %.0f grads %.0f optimizer %.0f (formula %.0f), "
            "comm peak %.0f (%.2f f32 units)\n",
            name, stage, n, params, grads, optim, formula[stage], comm, comm / unit_bytes);
    }
}

// 16-bit runs save their f32 masters and moments: at each ZeRO stage a bf16
// run resumed from its checkpoint continues bitwise like one never stopped
// (the masters loaded into this rank's slices, the 16-bit parameters
// rounded from them and gathered at stages 1-2), and another stage, or one
// process, loads the same state bitwise.
TEST(MixedPrecisionCheckpoints, ResumeBitwiseAtEveryZeroStage) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-bf16-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  auto make = [&](int stage, int steps, const std::string& resume, const std::string& dir,
                  bool one_process) {
    Config c =
        parse_config(kBase, "harness",
                     {"bf16.enabled=true", "zero_optimization.stage=" + std::to_string(stage),
                      "train.steps=" + std::to_string(steps), "checkpoint.dir=" + root + "/" + dir},
                     one_process ? 1 : n);
    RunOptions opt;
    opt.quiet = true;
    opt.resume = resume;
    if (!one_process) opt.parallel = make_parallel_context(world, GridShape{n});
    return std::make_unique<Trainer>(std::move(c), opt, ThreadConfig{});
  };
  for (int stage : {1, 2, 3}) {
    const std::string s = std::to_string(stage);
    auto a = make(stage, 3, "", "a" + s, false);
    a->run();
    a->save(0.0);
    const auto sa = whole_state(*a);
    const std::string ckpt = root + "/a" + s + "/step-00000003";
    auto b = make(stage, 6, ckpt, "b" + s, false);
    EXPECT_TRUE(whole_state(*b) == sa) << "stage " << stage;
    auto f = make(stage, 6, "", "f" + s, false);
    const std::vector<StepResult> rf = f->run();
    const std::vector<StepResult> rb = b->run();
    ASSERT_EQ(rb.size(), 3u);
    for (size_t k = 0; k < 3; ++k)
      EXPECT_EQ(rb[k].loss, rf[k + 3].loss) << "stage " << stage << ", step " << k + 4;
    EXPECT_TRUE(whole_state(*b) == whole_state(*f)) << "stage " << stage << ": final state";
    auto other = make(stage == 3 ? 1 : stage + 1, 3, ckpt, "o" + s, false);
    EXPECT_TRUE(whole_state(*other) == sa) << "stage " << stage << " -> another stage";
    auto one = make(0, 3, ckpt, "one" + s, true);
    EXPECT_TRUE(whole_state(*one) == sa) << "stage " << stage << " -> one process";
  }
  // Every rank done reading before the folder goes.
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::printf(
        "[ bf16 checkpoints ] world %d: ZeRO 1, 2, 3 resumed bitwise; loaded at another stage "
        "and in one process bitwise\n",
        n);
    std::filesystem::remove_all(root);
  }
}

// What a 16-bit run sends, as the record of every operation counts it: the
// parameter all-gathers (stages 1-3) and the gradient reductions (summed in
// f32 where they land, rounded once) move 16-bit elements, half the bytes
// of f32. (An all-reduce's blocks split unevenly over the ranks when its
// length does not divide, so a rank's share of the halving is within a
// few elements a bucket.) The step's comm_bytes is the sum of the record's
// events.
TEST(Zero, SixteenBitRunsSendHalfTheBytes) {
  const int n = runtime().world_size();
  for (int stage : {0, 1, 2, 3}) {
    double gathered[2] = {0, 0}, reduced[2] = {0, 0};
    for (const bool half : {false, true}) {
      Config c = parse_config(kBase, "harness",
                              {"parallel.data=" + std::to_string(n), "train.steps=6",
                               "zero_optimization.stage=" + std::to_string(stage),
                               std::string("bf16.enabled=") + (half ? "true" : "false")},
                              n);
      RunOptions o;
      o.quiet = true;
      o.parallel = make_parallel_context(runtime().world(CommOptions{}), GridShape{});
      Trainer t(std::move(c), o, ThreadConfig{});
      const StepResult r = t.train_step();
      const std::string dp_name = t.engine().context().dp->name();
      double sum = 0;
      for (const CommEvent& e : r.comm_events) {
        sum += e.sent_bytes;
        if (e.group != dp_name) continue;
        // Parameters; not the statistics of 8-byte words, nor the trainer's
        // per-rank times (two f32 values a rank, on the world, which is the
        // data-parallel group here).
        if (e.kind == "allgather" && is_float_storage(e.dtype) && e.count > 2) {
          gathered[half] += e.sent_bytes;
          EXPECT_EQ(e.wire, half ? DType::kBF16 : DType::kF32);
        }
        if ((e.kind == "allreduce" || e.kind == "reducescatter") && e.dtype != DType::kF64 &&
            e.count > 2) {
          reduced[half] += e.sent_bytes;
          EXPECT_EQ(e.wire, half ? DType::kBF16 : DType::kF32);
        }
      }
      EXPECT_EQ(r.comm_bytes, sum) << "stage " << stage;
      double dp = 0;
      for (const CommTotals& g : r.comm_groups)
        if (g.group == dp_name) dp = g.sent_bytes;
      EXPECT_GT(dp, 0) << "stage " << stage;
    }
    EXPECT_GT(reduced[0], 0) << "stage " << stage;
    EXPECT_NEAR(reduced[1], reduced[0] / 2, 1e-3 * reduced[0]) << "stage " << stage;
    if (stage >= 1) {  // the updated shards, gathered
      EXPECT_GT(gathered[0], 0) << "stage " << stage;
      EXPECT_EQ(gathered[1], gathered[0] / 2) << "stage " << stage;
    } else {
      EXPECT_EQ(gathered[0] + gathered[1], 0) << "stage " << stage << " gathers nothing";
    }
    if (runtime().world_rank() == 0)
      std::printf(
          "[ comm bytes ] stage %d N %d: gathered f32 %.0f bf16 %.0f, reduced f32 %.0f bf16 %.0f "
          "per step and rank\n",
          stage, n, gathered[0], gathered[1], reduced[0], reduced[1]);
  }
}

// comm.payloads: in a bf16 run the activations and their gradients cross
// ranks in bf16 (tensor-parallel regions, pipeline messages, the experts'
// all-to-all), half the bytes of comm.payloads f32; the first step's loss
// moves by a bf16 rounding of those tensors only.
TEST(Payloads, Bf16RunsSendHalfTheActivationBytes) {
  const int n = runtime().world_size();
  struct Case {
    std::string name;
    std::vector<std::string> keys;
  };
  std::vector<Case> cases = {
      {"tp 2", {"parallel.tensor=2"}},
      {"tp 2, sequence parallel", {"parallel.tensor=2", "parallel.sequence_parallel=true"}},
      {"pp 2", {"parallel.pipeline=2", "gradient_accumulation_steps=4"}},
      {"moe, ep 2",
       {"parallel.expert=2", "model.moe.num_experts=4", "model.moe.every_n_layers=2"}}};
  if (n >= 4)
    cases.push_back(
        {"tp 2 x pp 2",
         {"parallel.tensor=2", "parallel.pipeline=2", "gradient_accumulation_steps=4"}});
  for (const Case& k : cases) {
    int used = 1;  // ranks of one replica: tp x pp
    for (const std::string& key : k.keys)
      if (key.rfind("parallel.tensor=", 0) == 0 || key.rfind("parallel.pipeline=", 0) == 0)
        used *= std::stoi(key.substr(key.find('=') + 1));
    if (n % used != 0) continue;  // the world does not hold this layout
    // The group whose payloads are measured, by kind of operation.
    double bytes[2] = {0, 0}, loss[2] = {0, 0};
    for (const bool f32 : {true, false}) {
      std::vector<std::string> keys = k.keys;
      keys.push_back("parallel.data=" + std::to_string(n / used));
      keys.push_back("bf16.enabled=true");
      keys.push_back(std::string("comm.payloads=") + (f32 ? "f32" : "auto"));
      Config c = parse_config(kBase, "harness", keys, n);
      RunOptions o;
      o.quiet = true;
      o.parallel = make_parallel_context(
          runtime().world(CommOptions{}),
          GridShape{n, c.parallel.tensor, c.parallel.pipeline, c.parallel.expert,
                    c.parallel.context});
      Trainer t(std::move(c), o, ThreadConfig{});
      const StepResult r = t.train_step();
      const ParallelContext& ctx = t.engine().context();
      for (const CommEvent& e : r.comm_events) {
        // Tensor-parallel row statistics (f32 in both) hold one value per
        // row, at most the batch's 16 x 32; the tensors hold rows x 64.
        const bool tp = ctx.tp && e.group == ctx.tp->name() && e.count > 16 * 32;
        const bool pp = ctx.pp && e.group == ctx.pp->name() && e.kind == "send";
        const bool ep = ctx.ep && e.group == ctx.ep->name() && e.kind == "alltoall";
        if (!tp && !pp && !ep) continue;
        bytes[f32 ? 0 : 1] += e.sent_bytes;
        EXPECT_EQ(e.wire, f32 ? DType::kF32 : DType::kBF16) << k.name << ", " << e.kind;
      }
      loss[f32 ? 0 : 1] = r.loss;
    }
    EXPECT_GT(bytes[0], 0) << k.name;
    EXPECT_GT(bytes[1], 0) << k.name;
    // All-reduces split into blocks per rank, unevenly where the length does
    // not divide: within a few elements an operation of exact halving.
    EXPECT_NEAR(bytes[1], bytes[0] / 2, 1e-3 * bytes[0]) << k.name;
    EXPECT_NEAR(loss[1], loss[0], 1e-3 * loss[0]) << k.name;
    if (runtime().world_rank() == 0)
      std::printf("[ payloads ] %s, world %d: f32 %.0f bf16 %.0f bytes (%.3f), loss %.6f vs %.6f\n",
                  k.name.c_str(), n, bytes[0], bytes[1], bytes[1] / bytes[0], loss[0], loss[1]);
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
