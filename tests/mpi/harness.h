// What the multi-rank model tests share: the small GPT's base config, how
// to train it under a layout and collect what the harness compares, and
// the tolerances' shape (test_layouts.cc explains the figures).
#pragma once

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

namespace loom::test {

// Every rank's optimizer files go to the same folder (names carry the pid).
inline std::string nvme_dir() {
  static const std::string dir = [] {
    std::string d = (std::filesystem::temp_directory_path() / "loom-test-nvme").string();
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

// How far a layout may be from the one-process run: relative per-step loss
// and gradient norm, absolute final parameters (see the top of the file).
// Gradients: ||layout - one process|| / ||one process|| per tensor, at step
// 1 (reduction order alone: a few ulps, measured <= 8.4e-7 in f32 on 2
// ranks) and at the last step (after 20 steps the weights differ by up to a
// few 1e-6, which moves the gradients a little further: measured <= 1.8e-6).
// A gradient off by a constant factor c on one tensor shows as |c - 1|.
struct Tolerance {
  double loss = 1e-5, norm = 1e-4, param = 1e-4, grad_first = 1e-5, grad_last = 3e-5;
};

struct Layout {
  std::string name;
  std::vector<std::string> overrides;  // on top of the base config
  // Model changes the one-process reference takes too (a deeper model for
  // interleaving over four stages, 16-bit precision).
  std::vector<std::string> model = {};
  Tolerance tol = {};
};

inline const char* kBase = R"({
  "train_batch_size": 16,
  "gradient_clipping": 0.5,
  "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 20}},
  "model": {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32, "dropout": 0.1},
  "data": {"synthetic": true},
  "train": {"steps": 20, "seed": 17, "eval_steps": 3},
  "log": {"peak_gflops": 100},
  "kernels": {"gemm_inputs": "f32"}
})";
// (GEMM inputs pinned to f32: kernels.gemm_inputs auto would round them to
// 16 bits in bf16 runs on some CPUs alone; a layout that wants 16-bit
// inputs says kernels.gemm_inputs=16bit.)

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;  // before clipping; every parameter counted once
  double val_loss = 0;             // over 3 global batches
  std::map<std::string, std::vector<float>> params;  // every parameter, whole, by name
  // Every parameter's reduced gradient, whole, by name, after step 1 and
  // after the last step (as the optimizer used them: averaged, clipped).
  std::map<std::string, std::vector<float>> grads_first, grads_last;
};

// Every parameter of a trainer's model as its whole tensor, by name, on
// every rank (collective: slices are gathered over the tensor-parallel
// group, stages' parameters broadcast over the pipeline), the vocabulary
// without padding.
inline std::map<std::string, std::vector<float>> whole_params(Trainer& t) {
  return WholeModel(t.engine(), false).params_by_name();
}

// Parameters and both AdamW moments of every tensor, whole, by name
// (collective).
inline std::map<std::string, std::vector<float>> whole_state(Trainer& t) {
  WholeModel w(t.engine(), true);
  std::map<std::string, std::vector<float>> out;
  for (const Param& p : w.layout().params())
    for (auto [kind, prefix] :
         {std::pair{WholeModel::kParam, ""}, std::pair{WholeModel::kExpAvg, "exp_avg."},
          std::pair{WholeModel::kExpAvgSq, "exp_avg_sq."}}) {
      std::vector<float> x(static_cast<size_t>(p.shape.numel()));
      w.get(p, kind, x.data());
      out[prefix + p.name] = std::move(x);
    }
  return out;
}

inline RunResult train(const std::vector<std::string>& overrides,
                       std::shared_ptr<ProcessGroup> group) {
  int world = group ? group->size() : 1;
  Config c = parse_config(kBase, "harness", overrides, world);
  RunOptions o;
  o.quiet = true;
  o.parallel = make_parallel_context(
      std::move(group), GridShape{world, c.parallel.tensor, c.parallel.pipeline, c.parallel.expert,
                                  c.parallel.context});
  const int64_t steps = c.train.steps;
  Trainer t(std::move(c), o, ThreadConfig{});
  RunResult r;
  for (int64_t k = 0; k < steps; ++k) {
    const StepResult s = t.train_step();
    r.losses.push_back(s.loss), r.grad_norms.push_back(s.grad_norm);
    // Whole tensors assembled from shards and slices (collective).
    if (k == 0) r.grads_first = WholeModel(t.engine(), false, true).grads_by_name();
    if (k + 1 == steps) r.grads_last = WholeModel(t.engine(), false, true).grads_by_name();
  }
  r.val_loss = t.evaluate();
  // Gathered into whole tensors by name: flat offsets differ between layouts
  // (ZeRO pads every unit to a multiple of the ranks), and tensor
  // parallelism keeps a slice of each split tensor on every rank of its group.
  r.params = whole_params(t);
  return r;
}

}  // namespace loom::test
