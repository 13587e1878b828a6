// The layout-equivalence harness: the same small GPT trained for 20 steps
// under a parallel layout and in one process, from the same seed and data;
// per-step losses and gradient norms, every parameter's reduced gradient
// (whole, per tensor) after step 1 and the last step, and every final
// parameter compared. Every parallel strategy
// adds its layouts to the table below.
//
// Tolerances, from reduction order alone (all arithmetic is f32): the layouts
// sum the same per-sample gradients in another order (per rank, then across
// ranks), which moves each gradient by a few ulps; AdamW's normalisation keeps
// that from growing over 20 steps. Loss: relative difference <= 1e-5 per step.
// Parameters: maximum absolute difference <= 1e-4 (weights are O(0.02-1)).
// 16-bit layouts (bf16, fp16) are compared with a one-process run in the
// same precision, with the tolerances given and justified beside them.
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
  // Every parameter's reduced gradient, whole, by name, after step 1 and
  // after the last step (as the optimizer used them: averaged, clipped).
  std::map<std::string, std::vector<float>> grads_first, grads_last;
};

// Every parameter of a trainer's model as its whole tensor, by name, on
// every rank (collective: slices are gathered over the tensor-parallel
// group, stages' parameters broadcast over the pipeline), the vocabulary
// without padding.
std::map<std::string, std::vector<float>> whole_params(Trainer& t) {
  return WholeModel(t.engine(), false).params_by_name();
}

// Parameters and both AdamW moments of every tensor, whole, by name
// (collective).
std::map<std::string, std::vector<float>> whole_state(Trainer& t) {
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

RunResult train(const std::vector<std::string>& overrides, std::shared_ptr<ProcessGroup> group) {
  int world = group ? group->size() : 1;
  Config c = parse_config(kBase, "harness", overrides, world);
  RunOptions o;
  o.quiet = true;
  o.parallel = make_parallel_context(
      std::move(group),
      GridShape{world, c.parallel.tensor, c.parallel.pipeline, c.parallel.expert});
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
  // Mixtures of experts (blocks 1 and 3: 4 experts, top-2), with the
  // balancing losses, without and with dropping at capacity: each expert's
  // gradients reduce over the data-parallel group like any parameter's, and
  // every layout drops the same tokens (capacity 1.25 drops 3.7% of the
  // assignments at the last step). Routing is discontinuous: reduction
  // order moves a logit by ulps, and where two gates compete for the last
  // place of an expert within ulps the choice can flip (at capacity 1.0 one
  // did at step 12 between micro-batches of 16 and of 4 in one process).
  // The tolerance holds while no decision sits that close.
  const std::vector<std::string> moe = {"model.moe.num_experts=4", "model.moe.every_n_layers=2",
                                        "model.moe.z_loss_coef=0.001"};
  std::vector<std::string> moe_drop = moe;
  moe_drop.push_back("model.moe.capacity_factor=1.25");
  data.push_back({"moe 4 x top-2, dp", {dp}, moe});
  data.push_back({"moe 4 x top-2, capacity 1.25 (dropping), zero-2",
                  {dp, "zero_optimization.stage=2"},
                  moe_drop});
  std::vector<std::string> moe_bias = moe;
  moe_bias.push_back("model.moe.balancing=bias");
  moe_bias.push_back("model.moe.bias_update_rate=0.01");
  data.push_back({"moe, bias balancing, zero-3", {dp, "zero_optimization.stage=3"}, moe_bias});
  if (world == 2)
    data.push_back({"moe 4 x top-2, capacity 1.25, pp 2", {"parallel.pipeline=2", acc4}, moe_drop});
  if (world == 4)
    data.push_back({"moe 4 x top-2, capacity 1.25, pp 2 x dp 2, zero-3",
                    {"parallel.pipeline=2", acc4, "zero_optimization.stage=3"},
                    moe_drop});
  // Expert parallelism: the experts split over ep ranks, rows travelling by
  // all-to-all; expert gradients reduced over the ranks holding the same
  // experts, ZeRO shards too.
  const std::string ep2 = "parallel.expert=2";
  data.push_back({"moe, ep 2", {dp, ep2}, moe});
  data.push_back({"moe, ep 2, zero-2", {dp, ep2, "zero_optimization.stage=2"}, moe});
  data.push_back(
      {"moe, ep 2, capacity 1.25, zero-2", {dp, ep2, "zero_optimization.stage=2"}, moe_drop});
  data.push_back({"moe, ep 2, bias balancing, zero-3, accumulation 2",
                  {dp, ep2, "zero_optimization.stage=3", "gradient_accumulation_steps=2"},
                  moe_bias});
  // Fixed routers: by a hash of the token id, by the last tag token.
  const std::vector<std::string> hash = {"model.moe.num_experts=4", "model.moe.every_n_layers=2",
                                         "model.moe.router=hash", "model.moe.capacity_factor=1.25"};
  const std::vector<std::string> tag = {"model.moe.num_experts=4", "model.moe.every_n_layers=2",
                                        "model.moe.top_k=1", "model.moe.router=tag",
                                        "model.moe.tag_tokens=[7, 19, 42, 101, 200]"};
  data.push_back({"moe, hash router, capacity 1.25, ep 2", {dp, ep2}, hash});
  // Under tensor parallelism each rank routes its share of the sequences
  // (and the router's and experts' gradients are summed over the group);
  // with one sequence per micro-batch every rank routes it.
  const std::string tpw = "parallel.tensor=" + std::to_string(world);
  data.push_back({"moe, tp, capacity 1.25, sequences split", {tpw}, moe_drop});
  data.push_back({"moe, tp, micro-batch 1 (every rank routes it)",
                  {tpw, "gradient_accumulation_steps=16"},
                  moe});
  data.push_back(
      {"moe, hash router, tp, sequences split, zero-1", {tpw, "zero_optimization.stage=1"}, hash});
  data.push_back({"moe, tag router, zero-1", {dp, "zero_optimization.stage=1"}, tag});
  if (world == 4) {
    data.push_back({"moe, tag router, ep 2 x pp 2", {"parallel.pipeline=2", acc4, ep2}, tag});
    data.push_back({"moe, ep 4", {dp, "parallel.expert=4"}, moe});
    data.push_back(
        {"moe, tp 2 x pp 2, zero_bubble, bias balancing, sequences split",
         {"parallel.tensor=2", "parallel.pipeline=2", acc4, "parallel.schedule=zero_bubble"},
         moe_bias});
    data.push_back(
        {"moe, tag router, tp 2 x dp 2, zero-3, full recompute, sequences split",
         {"parallel.tensor=2", "zero_optimization.stage=3", "activation_checkpointing.policy=full"},
         tag});
    data.push_back({"moe, ep 4, capacity 1.25, zero-1",
                    {dp, "parallel.expert=4", "zero_optimization.stage=1"},
                    moe_drop});
    data.push_back({"moe, ep 2 x dp 2, capacity 1.25, zero-2",
                    {dp, ep2, "zero_optimization.stage=2"},
                    moe_drop});
    data.push_back({"moe, ep 2 x dp 2, zero-3", {dp, ep2, "zero_optimization.stage=3"}, moe});
    data.push_back({"moe, ep 2 x tp 2", {"parallel.tensor=2", ep2}, moe});
    data.push_back({"moe, ep 2 x tp 2, capacity 1.25, zero-2",
                    {"parallel.tensor=2", ep2, "zero_optimization.stage=2"},
                    moe_drop});
    data.push_back({"moe, ep 2 x pp 2", {"parallel.pipeline=2", acc4, ep2}, moe});
    data.push_back({"moe, ep 2 x pp 2, capacity 1.25, 1f1b, full recompute",
                    {"parallel.pipeline=2", acc4, ep2, "activation_checkpointing.policy=full"},
                    moe_drop});
  }
  // 16-bit precision, the one-process reference in the same precision.
  // Gradients are rounded to 16 bits where a layout holds them (each rank's
  // before they are reduced, the sum over micro-batches as it accumulates),
  // so a layout and one process differ by a 16-bit rounding of some
  // gradients (2^-8 relative in bf16, 2^-11 in fp16), not only by reduction
  // order. The loss moves little (measured: <= 5e-6 relative per step); a
  // gradient element near zero can change sign, and AdamW moves it by about
  // lr (2e-3) whatever its size, so parameters may differ by up to a step's
  // update (measured: <= 9e-4 in bf16, 7e-5 in fp16). Grad norms: <= 4e-4
  // measured. Mixtures of experts also flip routing choices that compete
  // within a 16-bit rounding of a router weight, which is chaotic (measured
  // in bf16: loss 2.4e-4, norm 2.3e-2, parameters 6.4e-3 to 7.4e-3 across
  // builds and rank counts); their bounds leave a factor of 3-4, far below
  // what a misrouted row or a lost expert gradient would do (O(1)).
  // These layouts keep the activation records in f32
  // (activation_checkpointing.activation_dtype f32), so that the
  // gradients' path is held to the tight bound; the 16-bit records'
  // layouts follow with theirs.
  // Gradients in 16 bits: a layout's reduced gradient is rounded where one
  // process's is not (or the other way), a rounding or two of the type
  // (2^-8 bf16, 2^-11 fp16) per element at step 1 (measured on 2 and 4
  // ranks: 4.6e-3 bf16, 6.7e-4 fp16); by the last step the weights'
  // differences add (measured: 8.5e-3 bf16, 9.0e-4 fp16; with 16-bit GEMM
  // inputs 1.2e-2 and 1.5e-3). MoE
  // routing flips by the last step move whole rows between experts
  // (measured 0.22-0.40 relative on an expert's tensor, varying with the
  // build and CPU), so there the last step is not compared and step 1 is
  // the check.
  for (const char* t : {"bf16", "fp16"}) {
    const std::vector<std::string> on = {std::string(t) + ".enabled=true",
                                         "activation_checkpointing.activation_dtype=f32"};
    const std::string n = t;
    const bool bf = n == "bf16";
    const double g1 = bf ? 8e-3 : 1.2e-3;
    const Tolerance half{2e-5, 2e-3, 2e-3, g1, bf ? 2e-2 : 3e-3};
    const Tolerance half_moe{1e-3, 1e-1, 3e-2, g1, INFINITY};
    data.push_back({n + ", dp", {dp, "zero_optimization.reduce_bucket_size=20000"}, on, half});
    data.push_back({n + ", zero-1, accumulation 2",
                    {dp, "zero_optimization.stage=1", "gradient_accumulation_steps=2"},
                    on,
                    half});
    data.push_back({n + ", zero-2", {dp, "zero_optimization.stage=2"}, on, half});
    data.push_back({n + ", zero-3, nothing resident",
                    {dp, "zero_optimization.stage=3",
                     "zero_optimization.stage3_param_persistence_threshold=0"},
                    on,
                    half});
    data.push_back({n + ", tp", {tpw}, on, half});
    if (world == 2)
      data.push_back({n + ", pp 2, zero_bubble",
                      {"parallel.pipeline=2", acc4, "parallel.schedule=zero_bubble"},
                      on,
                      half});
    if (world == 4)
      data.push_back({n + ", pp 2 x dp 2, zero-1",
                      {"parallel.pipeline=2", acc4, "zero_optimization.stage=1"},
                      on,
                      half});
    if (n == "bf16")  // the masters in the nvme file beside the moments
      data.push_back(
          {n + ", zero-2, optimizer in nvme files",
           {dp, "zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=nvme",
            "zero_optimization.offload_optimizer.nvme_path=" + nvme_dir()},
           on,
           half});
    // 16-bit activation records (the default of a 16-bit run) and GEMMs
    // on 16-bit inputs, the one-process reference alike. Rounding an
    // activation to 16 bits is discontinuous: a reduction-order difference
    // of an ulp of f32 upstream can move it by an ulp of bf16 (fp16), so
    // more gradient elements near zero change sign, each moving by up to lr
    // per step (20 steps: up to 4e-2). Measured with 16-bit GEMM inputs:
    // parameters 1.4e-2 (bf16), 5.8e-3 (fp16), losses 1.4e-5, norms
    // 7.1e-4; with 16-bit records: parameters 1.3e-2 (bf16), 3.9e-3 (fp16),
    // losses 8.3e-6, norms 4.0e-4. The recompute policy is the reference's
    // too: with 16-bit records a recomputed part is computed from rounded
    // values, so policies no longer agree bit for bit.
    const Tolerance half_gemm{3e-5, 2e-3, n == "bf16" ? 3e-2 : 1e-2, g1, bf ? 3e-2 : 5e-3};
    const std::string records = n + ", 16-bit records";
    data.push_back({records + ", zero-2", {dp, "zero_optimization.stage=2"}, {on[0]}, half_gemm});
    data.push_back({records + ", tp, sequence parallel, selective recompute",
                    {tpw, "parallel.sequence_parallel=true"},
                    {on[0], "activation_checkpointing.policy=selective"},
                    half_gemm});
    if (world == 2)
      data.push_back(
          {records + ", pp 2, zero_bubble, every 2nd block recomputed",
           {"parallel.pipeline=2", acc4, "parallel.schedule=zero_bubble"},
           {on[0], "activation_checkpointing.policy=every_n", "activation_checkpointing.every_n=2"},
           half_gemm});
    if (world == 4)
      data.push_back({records + ", pp 2 x dp 2, zero-3",
                      {"parallel.pipeline=2", acc4, "zero_optimization.stage=3"},
                      {on[0]},
                      half_gemm});
    data.push_back({n + ", 16-bit GEMM inputs, tp, sequence parallel",
                    {tpw, "parallel.sequence_parallel=true"},
                    {on[0], "kernels.gemm_inputs=16bit"},
                    half_gemm});
    data.push_back({n + ", 16-bit GEMM inputs, zero-2",
                    {dp, "zero_optimization.stage=2"},
                    {on[0], "kernels.gemm_inputs=16bit"},
                    half_gemm});
    // (16-bit GEMMs read the gathered 16-bit units, and the zero-bubble
    // B pass the 16-bit weights before W runs.)
    data.push_back({n + ", 16-bit GEMM inputs, zero-3, nothing resident",
                    {dp, "zero_optimization.stage=3",
                     "zero_optimization.stage3_param_persistence_threshold=0"},
                    {on[0], "kernels.gemm_inputs=16bit"},
                    half_gemm});
    if (world == 2)
      data.push_back({n + ", 16-bit GEMM inputs, pp 2, zero_bubble",
                      {"parallel.pipeline=2", acc4, "parallel.schedule=zero_bubble"},
                      {on[0], "kernels.gemm_inputs=16bit"},
                      half_gemm});
    // Mixtures of experts with 16-bit records (the router's logits stay f32).
    std::vector<std::string> moe_half = moe;
    moe_half.push_back(on[0]);
    data.push_back(
        {n + ", moe, ep 2, zero-2", {dp, ep2, "zero_optimization.stage=2"}, moe_half, half_moe});
    moe_half.push_back("kernels.gemm_inputs=16bit");
    data.push_back({n + ", moe, ep 2, zero-3, 16-bit GEMM inputs",
                    {dp, ep2, "zero_optimization.stage=3"},
                    moe_half,
                    half_moe});
  }
  // (A step skipped for an fp16 overflow: NonFinite below. Overflows that
  // arise by themselves depend on the layout: a rank's gradients, rounded
  // to fp16 before they are reduced, are its own samples' mean, which can
  // exceed the range where the global mean does not.)
  return data;
}

// ||a - b|| / ||b|| of each tensor of `want`, by name.
std::map<std::string, double> relative_errors(
    const std::map<std::string, std::vector<float>>& have,
    const std::map<std::string, std::vector<float>>& want) {
  std::map<std::string, double> out;
  for (const auto& [name, w] : want) {
    const std::vector<float>& h = have.at(name);
    double d = 0, n = 0;
    for (size_t i = 0; i < w.size() && i < h.size(); ++i)
      d += (double(h[i]) - w[i]) * (double(h[i]) - w[i]), n += double(w[i]) * w[i];
    out[name] = h.size() != w.size() ? INFINITY : n > 0 ? std::sqrt(d / n) : std::sqrt(d);
  }
  return out;
}

// The tensors whose gradient is further than `tol` from the reference's.
std::vector<std::string> gradient_mismatches(const std::map<std::string, std::vector<float>>& have,
                                             const std::map<std::string, std::vector<float>>& want,
                                             double tol, double* worst) {
  std::vector<std::string> bad;
  for (const auto& [name, e] : relative_errors(have, want)) {
    *worst = std::max(*worst, e);
    if (!(e <= tol)) bad.push_back(name);
  }
  return bad;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) {
    if (!s.empty()) s += ", ";
    s += n;
  }
  return s;
}

void expect_like_one_process(const Layout& layout) {
  // One process, micro-batch 16 (the reference of each model, kept).
  static std::map<std::vector<std::string>, RunResult> refs;
  if (!refs.count(layout.model)) refs[layout.model] = train(layout.model, nullptr);
  const RunResult& ref = refs[layout.model];
  ASSERT_EQ(ref.losses.size(), 20u);
  // The reference trains: its parameters and gradients move.
  EXPECT_NE(ref.losses.back(), ref.losses.front()) << layout.name;
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
      EXPECT_LE(std::abs(got.losses[s] - ref.losses[s]), layout.tol.loss * std::abs(ref.losses[s]))
          << layout.name << ", step " << s + 1 << ": " << got.losses[s] << " vs " << ref.losses[s];
    // A skipped step (non-finite norm) must be skipped alike.
    int skipped = 0;
    for (size_t s = 0; s < ref.grad_norms.size(); ++s) {
      if (!std::isfinite(ref.grad_norms[s])) {
        ++skipped;
        EXPECT_FALSE(std::isfinite(got.grad_norms[s])) << layout.name << ", step " << s + 1;
        continue;
      }
      EXPECT_LE(std::abs(got.grad_norms[s] - ref.grad_norms[s]),
                layout.tol.norm * ref.grad_norms[s])
          << layout.name << ", step " << s + 1 << ": grad norm " << got.grad_norms[s] << " vs "
          << ref.grad_norms[s];
    }

    EXPECT_LE(std::abs(got.val_loss - ref.val_loss), layout.tol.loss * ref.val_loss)
        << layout.name << ": validation loss " << got.val_loss << " vs " << ref.val_loss;
    double maxdiff = 0;
    ASSERT_EQ(got.params.size(), ref.params.size()) << layout.name;
    for (const auto& [name, want] : ref.params) {
      const std::vector<float>& have = got.params.at(name);
      ASSERT_EQ(have.size(), want.size()) << layout.name << ": " << name;
      for (size_t i = 0; i < want.size(); ++i)
        maxdiff = std::max(maxdiff, double(std::abs(have[i] - want[i])));
    }
    EXPECT_LE(maxdiff, layout.tol.param) << layout.name;
    // Every parameter's reduced gradient, per tensor: what AdamW and
    // clipping would hide (a constant factor on one tensor cancels in
    // m / sqrt(v)).
    double grad_first = 0, grad_last = 0;
    ASSERT_EQ(got.grads_first.size(), ref.grads_first.size()) << layout.name;
    EXPECT_EQ(joined(gradient_mismatches(got.grads_first, ref.grads_first, layout.tol.grad_first,
                                         &grad_first)),
              "")
        << layout.name << ": gradients at step 1 differ (worst " << grad_first << ")";
    EXPECT_EQ(joined(gradient_mismatches(got.grads_last, ref.grads_last, layout.tol.grad_last,
                                         &grad_last)),
              "")
        << layout.name << ": gradients at the last step differ (worst " << grad_last << ")";
    double loss_rel = 0, norm_rel = 0;
    for (size_t s = 0; s < ref.losses.size(); ++s) {
      loss_rel = std::max(loss_rel, std::abs(got.losses[s] - ref.losses[s]) / ref.losses[s]);
      if (std::isfinite(ref.grad_norms[s]))
        norm_rel =
            std::max(norm_rel, std::abs(got.grad_norms[s] - ref.grad_norms[s]) / ref.grad_norms[s]);
    }
    if (runtime().world_rank() == 0)
      std::printf(
          "[ layout ] %-48s world %d: max |param diff| %.2e, final loss %.6f (ref %.6f), "
          "max rel. loss diff %.1e, grad norm %.1e, grads step 1 %.1e, last %.1e%s\n",
          layout.name.c_str(), runtime().world_size(), maxdiff, got.losses.back(),
          ref.losses.back(), loss_rel, norm_rel, grad_first, grad_last,
          skipped > 0 ? (", " + std::to_string(skipped) + " steps skipped").c_str() : "");
  }
}

// LOOM_TEST_LAYOUTS=TEXT|TEXT... runs only the layouts whose name contains
// one of the TEXTs (the cross-host run picks its layouts so).
TEST(Layouts, TrainExactlyLikeOneProcess) {
  const char* only = std::getenv("LOOM_TEST_LAYOUTS");
  std::vector<std::string> wanted;
  for (std::string rest = only ? only : ""; !rest.empty();) {
    const size_t bar = rest.find('|');
    wanted.push_back(rest.substr(0, bar));
    rest = bar == std::string::npos ? "" : rest.substr(bar + 1);
  }
  int ran = 0;
  for (const Layout& layout : layouts(runtime().world_size())) {
    bool pick = wanted.empty();
    for (const std::string& w : wanted) pick |= layout.name.find(w) != std::string::npos;
    if (!pick) continue;
    expect_like_one_process(layout);
    ++ran;
  }
  EXPECT_GT(ran, 0) << "LOOM_TEST_LAYOUTS=" << (only ? only : "") << " picks no layout";
}

// The gradient check can fail: a layout whose one tensor's gradient is off
// by a constant factor (LOOM_TEST_GRAD_SCALE: a gradient summed twice, a
// missing 1/ep) trains within every other bound, since AdamW's m / sqrt(v)
// cancels the factor, and is caught by the per-tensor gradient comparison
// alone, naming the tensor.
TEST(Layouts, AGradientWrongByAConstantFactorIsCaught) {
  const std::string name = "transformer.h.2.attn.c_proj.bias";
  const std::string dp = "parallel.data=" + std::to_string(runtime().world_size());
  // Without clipping, which would spread the factor over every tensor.
  const RunResult ref = train({"gradient_clipping=0"}, nullptr);
  setenv("LOOM_TEST_GRAD_SCALE", (name + ":2").c_str(), 1);
  CommOptions opt;
  opt.timeout_s = 120;
  const RunResult got =
      train({"gradient_clipping=0", dp, "zero_optimization.stage=2"}, runtime().world(opt));
  unsetenv("LOOM_TEST_GRAD_SCALE");
  const Tolerance tol;
  double worst = 0;
  EXPECT_EQ(joined(gradient_mismatches(got.grads_first, ref.grads_first, tol.grad_first, &worst)),
            name);
  EXPECT_EQ(joined(gradient_mismatches(got.grads_last, ref.grads_last, tol.grad_last, &worst)),
            name);
  EXPECT_NEAR(relative_errors(got.grads_first, ref.grads_first).at(name), 1.0, 1e-3);
  // The losses stay within their bound: only the gradients show it.
  for (size_t s = 0; s < ref.losses.size(); ++s)
    EXPECT_LE(std::abs(got.losses[s] - ref.losses[s]), 1e-4 * ref.losses[s]) << "step " << s + 1;
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

// The all-to-all dispatcher alone: every rank's rows for each expert (some
// blocks empty) arrive at the expert's rank, expert by expert and within an
// expert rank by rank; combine brings each row back to its place. Row
// values name (rank, expert, row, column), so any misplaced row shows.
TEST(ExpertParallel, DispatchSendsEveryRowToItsExpertAndCombineBringsItBack) {
  auto world = runtime().world(CommOptions{});
  const int P = world->size(), me = world->rank(), L = 2, E = P * L;
  const int64_t C = 3;
  if (P == 1) GTEST_SKIP() << "needs 2 ranks";
  ep::AllToAllDispatcher d(world);
  auto count = [&](int r, int e) { return int64_t{(r * 5 + e * 3) % 4}; };  // 0 to 3 rows
  auto value = [](int r, int e, int64_t i, int64_t c) {
    return static_cast<float>(r * 1000 + e * 100 + i * 10 + c);
  };
  std::vector<int64_t> mine(static_cast<size_t>(E));
  std::vector<float> rows;
  for (int e = 0; e < E; ++e) {
    mine[static_cast<size_t>(e)] = count(me, e);
    for (int64_t i = 0; i < count(me, e); ++i)
      for (int64_t c = 0; c < C; ++c) rows.push_back(value(me, e, i, c));
  }
  const ExpertPlan p = d.plan(mine, E);
  std::vector<float> want;
  for (int le = 0; le < L; ++le) {
    const int e = me * L + le;
    int64_t n = 0;
    for (int s = 0; s < P; ++s)
      for (int64_t i = 0; i < count(s, e); ++i, ++n)
        for (int64_t c = 0; c < C; ++c) want.push_back(value(s, e, i, c));
    EXPECT_EQ(p.offsets[static_cast<size_t>(le) + 1] - p.offsets[static_cast<size_t>(le)], n)
        << "local expert " << le;
  }
  std::vector<float> got(static_cast<size_t>(p.rows() * C), -1.0f);
  d.dispatch(p, rows.data(), C, got.data());
  EXPECT_EQ(got, want);
  for (float& x : got) x += 0.5f;  // what the experts did
  std::vector<float> back(rows.size(), -1.0f);
  d.combine(p, got.data(), C, back.data());
  for (float& x : rows) x += 0.5f;
  EXPECT_EQ(back, rows);
  const ep::AllToAllStats st = d.take_stats();
  EXPECT_EQ(st.calls, 2);
  world->barrier()->wait();
}

// Under expert parallelism each rank writes the experts it holds under
// their global names (transformer.h.1.mlp.experts.3.c_fc.weight), so a
// checkpoint loads bitwise in one process and at any other expert-parallel
// size (and at another ZeRO stage), a resumed run continues bitwise, and the
// whole format (gathered from the expert ranks) loads alike.
TEST(ExpertParallel, CheckpointsHoldEveryExpertAndLoadAtAnyEpBitwise) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-ep-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  auto make = [&](int ep, int stage, int steps, const std::string& resume, const std::string& dir,
                  bool one_process, std::vector<std::string> extra = {}) {
    std::vector<std::string> o = {"model.moe.num_experts=4",
                                  "model.moe.every_n_layers=2",
                                  "parallel.expert=" + std::to_string(ep),
                                  "zero_optimization.stage=" + std::to_string(stage),
                                  "train.steps=" + std::to_string(steps),
                                  "checkpoint.every=3",
                                  "checkpoint.dir=" + root + "/" + dir};
    o.insert(o.end(), extra.begin(), extra.end());
    Config c = parse_config(kBase, "harness", o, one_process ? 1 : n);
    RunOptions opt;
    opt.quiet = true;
    opt.resume = resume;
    if (!one_process) opt.parallel = make_parallel_context(world, GridShape{n, 1, 1, ep});
    return std::make_unique<Trainer>(std::move(c), opt, ThreadConfig{});
  };
  const std::string step = "/step-00000003";
  // A: ep n at ZeRO-2, 3 steps, saved.
  auto a = make(n, 2, 3, "", "a", false);
  a->run();
  const auto sa = whole_state(*a);
  ASSERT_TRUE(sa.count("transformer.h.1.mlp.experts.3.c_fc.weight"));
  if (world->rank() == 0) {
    const std::string manifest = read_file(root + "/a" + step + "/manifest.json");
    for (int e = 0; e < 4; ++e)
      EXPECT_NE(
          manifest.find("\"transformer.h.3.mlp.experts." + std::to_string(e) + ".c_proj.weight\""),
          std::string::npos)
          << "expert " << e << " in the manifest";
  }
  // B: one process from it (every rank alone), then saved by rank 0.
  auto b = make(1, 0, 3, root + "/a" + step, "b", true);
  EXPECT_TRUE(whole_state(*b) == sa) << "ep " << n << " -> one process";
  if (world->rank() == 0) b->save(0.0);
  world->barrier()->wait();
  // C: ep n at ZeRO-3 from the one-process checkpoint.
  auto c = make(n, 3, 3, root + "/b" + step, "c", false);
  EXPECT_TRUE(whole_state(*c) == sa) << "one process -> ep " << n << ", zero-3";
  if (n == 4) {
    // D: ep 2 (x dp 2) at ZeRO-1 from A's ep-4 checkpoint.
    auto d = make(2, 1, 3, root + "/a" + step, "d", false);
    EXPECT_TRUE(whole_state(*d) == sa) << "ep 4 -> ep 2 x dp 2";
  }
  // E: A resumed for 3 more steps continues as F, never stopped.
  auto e = make(n, 2, 6, root + "/a" + step, "e", false);
  auto f = make(n, 2, 6, "", "f", false);
  const std::vector<StepResult> rf = f->run();
  const std::vector<StepResult> re = e->run();
  ASSERT_EQ(re.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(re[k].loss, rf[k + 3].loss) << "step " << k + 4;
  EXPECT_TRUE(whole_state(*e) == whole_state(*f)) << "resumed run's final state";
  // G: the whole format, its experts gathered from their ranks.
  auto g = make(n, 2, 3, "", "g", false, {"checkpoint.format=whole"});
  g->run();
  auto h = make(1, 0, 3, root + "/g" + step, "h", true);
  EXPECT_TRUE(whole_state(*h) == whole_state(*g)) << "whole format, ep " << n << " -> one process";
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf(
        "[ ep checkpoints ] world %d: ep %d -> 1 -> ep %d (zero-3)%s bitwise; resume "
        "bitwise; whole format\n",
        n, n, n, n == 4 ? ", ep 4 -> ep 2 x dp 2" : "");
  }
}

// A checkpoint saved under any tensor-parallel size loads under any other
// (its pieces reassembled into the new slices): parameters and AdamW
// moments come back bitwise. tp N -> one process -> tp N, and at 4 ranks tp 4 -> tp 2 -> tp 4.
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

// Checkpoints of a pipelined run (each stage writes its own tensors) load
// in one process and at another pipeline size with parameters and AdamW moments
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
  auto state = [](Trainer& t) { return whole_state(t); };
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

// /proc/self/status's `key` in bytes.
size_t status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(std::strlen(key) + 1)) * 1024;
  return 0;
}
// Whether the resident set measures loom's memory: not under AddressSanitizer,
// whose shadow memory and quarantine of freed blocks move it by megabytes.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssMeaningful = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kRssMeaningful = false;
#else
constexpr bool kRssMeaningful = true;
#endif
#else
constexpr bool kRssMeaningful = true;
#endif

// Starts a new peak resident set (VmHWM) at the current size; false where
// the kernel does not offer it.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return f.good();
}

// Sharded checkpoints at every ZeRO stage: each rank writes its own shard,
// and a save or a resume at stage 3 holds no more than the model state plus
// one unit's buffers (the tracked peak and the resident set's high-water
// mark both); the checkpoint loads bitwise at stages 0, 1 and 2, in one
// process, and from a one-process save back at stage 3; async saves write
// the same bytes as synchronous ones; a resumed run continues bitwise.
TEST(ShardedCheckpoint, EveryZeroStageSavesAndResumesWithinStatePlusOneUnit) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-zero-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  using State = std::map<std::string, std::vector<float>>;
  // A model large enough for memory to show: units of ~3 MB.
  auto make = [&](int stage, int steps, const std::string& resume, const std::string& dir,
                  bool one_process, std::vector<std::string> extra = {}) {
    std::vector<std::string> o = {
        "model.n_embd=256", "model.n_layer=2", "zero_optimization.stage=" + std::to_string(stage),
        "train.steps=" + std::to_string(steps), "checkpoint.dir=" + root + "/" + dir};
    o.insert(o.end(), extra.begin(), extra.end());
    Config c = parse_config(kBase, "harness", o, one_process ? 1 : n);
    RunOptions opt;
    opt.quiet = true;
    opt.resume = resume;
    if (!one_process) opt.parallel = make_parallel_context(world, GridShape{n});
    return std::make_unique<Trainer>(std::move(c), opt, ThreadConfig{});
  };
  auto unit_bytes = [](Trainer& t) {
    int64_t most = 0;
    for (const Unit& u : t.model().layout().units()) most = std::max(most, u.size());
    return static_cast<size_t>(most) * sizeof(float);
  };
  auto total = [](const std::array<size_t, kNumMemCategories>& a) {
    size_t s = 0;
    for (size_t x : a) s += x;
    return s;
  };
  const bool rss = reset_peak_rss() && kRssMeaningful;
  constexpr size_t kSlack = 2 << 20;  // allocator and file-system noise
  const std::string step = "/step-00000003";

  // A: stage 3 on n ranks, 3 steps, saved; the save measured.
  auto a = make(3, 3, "", "a", false);
  a->run();
  const size_t unit = unit_bytes(*a);
  memory_tracker().reset_peaks();
  reset_peak_rss();
  const size_t rss_before = status_bytes("VmRSS:");
  a->save(0.0);
  const size_t save_rss = status_bytes("VmHWM:") - rss_before;
  const MemStats ms = memory_tracker().stats();
  EXPECT_LE(total(ms.peak) - total(ms.current), unit) << "tracked peak during save";
  if (rss) {
    EXPECT_LE(save_rss, unit + kSlack) << "resident set growth during save";
  }
  const State sa = whole_state(*a);
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(std::filesystem::exists(root + "/a" + step + "/" + shard_file_name(r)));

  // B: stage 3 resumed on n ranks: the load measured, the state bitwise.
  memory_tracker().reset_peaks();
  reset_peak_rss();
  auto b = make(3, 6, root + "/a" + step, "b", false);
  const MemStats mb = memory_tracker().stats();
  const size_t load_rss = status_bytes("VmHWM:") - status_bytes("VmRSS:");
  EXPECT_LE(total(mb.peak) - total(mb.current), unit) << "tracked peak above state at resume";
  if (rss) {
    EXPECT_LE(load_rss, unit + kSlack) << "resident set above state at resume";
  }
  EXPECT_TRUE(whole_state(*b) == sa) << "stage 3 -> stage 3";
  // ... and continues as a run never stopped.
  auto f = make(3, 6, "", "f", false);
  const std::vector<StepResult> rf = f->run();
  const std::vector<StepResult> rb = b->run();
  ASSERT_EQ(rb.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(rb[k].loss, rf[k + 3].loss) << "step " << k + 4;
  EXPECT_TRUE(whole_state(*b) == whole_state(*f)) << "resumed run's final state";

  // Other stages and one process load it bitwise.
  for (int stage : {0, 1, 2}) {
    auto c = make(stage, 3, root + "/a" + step, "c", false);
    EXPECT_TRUE(whole_state(*c) == sa) << "stage 3 -> stage " << stage;
  }
  auto one = make(0, 3, root + "/a" + step, "one", true);
  EXPECT_TRUE(whole_state(*one) == sa) << "stage 3 on " << n << " ranks -> one process";
  if (world->rank() == 0) one->save(0.0);
  world->barrier()->wait();
  auto back = make(3, 3, root + "/one" + step, "back", false);
  EXPECT_TRUE(whole_state(*back) == sa) << "one process -> stage 3";

  // Async saves (every step, overlapping the next) write the same files.
  auto sync = make(2, 4, "", "sync", false, {"checkpoint.every=2"});
  sync->run();
  auto async = make(2, 4, "", "async", false, {"checkpoint.every=2", "checkpoint.async=true"});
  async->run();
  if (world->rank() == 0) {
    for (const char* s : {"/step-00000002/", "/step-00000004/"})
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(read_file(root + "/sync" + s + shard_file_name(r)),
                  read_file(root + "/async" + s + shard_file_name(r)))
            << s << shard_file_name(r);
      }
  }
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf(
        "[ sharded checkpoints ] world %d, stage 3: save +%.2f MB resident, resume +%.2f MB "
        "above state (largest unit %.2f MB%s); stages 0-2, one process, back: bitwise; async = "
        "sync\n",
        n, save_rss / 1e6, load_rss / 1e6, unit / 1e6, rss ? "" : ", resident set not measured");
  }
}

// A step whose gradients hold a NaN (LOOM_TEST_NONFINITE puts one into a
// parameter's reduced gradient where a rank holds it) is skipped on every
// rank at once with train.on_nonfinite skip: parameters and moments stay as
// they were, the schedule does not advance, and every layout then trains
// like one process doing the same.
// In every precision: f32 and bf16 skip the step (train.on_nonfinite:
// skip), fp16 skips it as an overflow and halves the loss scale (hysteresis
// 1); every rank agrees, and the state is left as it was.
TEST(NonFinite, ASkippedStepIsSkippedEverywhereAndTrainsLikeOneProcess) {
  const int n = runtime().world_size();
  auto world = runtime().world(CommOptions{});
  ::setenv("LOOM_TEST_NONFINITE", "3:transformer.h.1.mlp.c_fc.weight", 1);
  for (const std::string precision : {"f32", "bf16", "fp16"}) {
    std::vector<std::string> base = {"train.steps=6", "train.on_nonfinite=skip",
                                     "gradient_accumulation_steps=4"};
    // (Activation records in f32: the 16-bit layouts' tight bounds; the
    // skip does not depend on them.)
    if (precision != "f32")
      base.insert(base.end(),
                  {precision + ".enabled=true", "activation_checkpointing.activation_dtype=f32"});
    if (precision == "fp16") base.push_back("fp16.hysteresis=1");
    // 16-bit: the tolerances of the 16-bit layouts above.
    const double loss_tol = precision == "f32" ? 1e-5 : 2e-5;
    const double param_tol = precision == "f32" ? 1e-4 : 2e-3;
    auto make = [&](std::vector<std::string> extra, bool one_process, GridShape shape) {
      extra.insert(extra.end(), base.begin(), base.end());
      Config c = parse_config(kBase, "harness", extra, one_process ? 1 : n);
      RunOptions o;
      o.quiet = true;
      if (!one_process) o.parallel = make_parallel_context(world, shape);
      return std::make_unique<Trainer>(std::move(c), o, ThreadConfig{});
    };
    // One process, step by step: the skipped step leaves the state as it was.
    auto ref = make({}, true, GridShape{});
    std::vector<StepResult> want;
    want.push_back(ref->train_step());
    want.push_back(ref->train_step());
    const auto before = whole_state(*ref);
    want.push_back(ref->train_step());
    EXPECT_EQ(want.back().skipped_steps, 1) << precision;
    EXPECT_TRUE(whole_state(*ref) == before) << precision << ": the skipped step changed the state";
    for (int k = 0; k < 3; ++k) want.push_back(ref->train_step());
    EXPECT_EQ(want.back().skipped_steps, 1) << precision;
    if (precision == "fp16") {
      EXPECT_EQ(want[2].loss_scale, 65536.0);
      EXPECT_EQ(want[3].loss_scale, 32768.0) << "the overflow halves the scale";
    }
    const auto want_params = whole_params(*ref);
    struct L {
      std::string name;
      std::vector<std::string> set;
      GridShape shape;
    };
    for (const L& l : {L{"dp, zero-2", {"zero_optimization.stage=2"}, GridShape{n}},
                       L{"tp", {"parallel.tensor=" + std::to_string(n)}, GridShape{n, n}},
                       L{"pp", {"parallel.pipeline=" + std::to_string(n)}, GridShape{n, 1, n}}}) {
      auto t = make(l.set, false, l.shape);
      const std::vector<StepResult> got = t->run();
      ASSERT_EQ(got.size(), want.size()) << l.name;
      for (size_t k = 0; k < got.size(); ++k) {
        EXPECT_EQ(got[k].skipped_steps, k >= 2 ? 1 : 0)
            << precision << ", " << l.name << " step " << k + 1;
        EXPECT_EQ(got[k].loss_scale, want[k].loss_scale) << precision << ", " << l.name;
        EXPECT_LE(std::abs(got[k].loss - want[k].loss), loss_tol * std::abs(want[k].loss))
            << precision << ", " << l.name << " step " << k + 1;
      }
      const auto params = whole_params(*t);
      double worst = 0;
      for (const auto& [name, w] : want_params)
        for (size_t i = 0; i < w.size(); ++i)
          worst = std::max(worst, double(std::abs(params.at(name)[i] - w[i])));
      EXPECT_LE(worst, param_tol) << precision << ", " << l.name;
    }
    if (world->rank() == 0)
      std::printf(
          "[ non-finite ] world %d, %s: step 3 skipped on every rank under dp zero-2, tp %d, "
          "pp %d, as in one process\n",
          n, precision.c_str(), n, n);
  }
  ::unsetenv("LOOM_TEST_NONFINITE");
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
      {"moe, ep 2", {"parallel.expert=2", "model.moe.num_experts=4", "model.moe.every_n_layers=2"}}};
  if (n >= 4)
    cases.push_back(
        {"tp 2 x pp 2", {"parallel.tensor=2", "parallel.pipeline=2", "gradient_accumulation_steps=4"}});
  for (const Case& k : cases) {
    // The group whose payloads are measured, by kind of operation.
    double bytes[2] = {0, 0}, loss[2] = {0, 0};
    for (const bool f32 : {true, false}) {
      std::vector<std::string> keys = k.keys;
      int used = 1;
      for (const std::string& key : keys)
        if (key.rfind("parallel.tensor=", 0) == 0 || key.rfind("parallel.pipeline=", 0) == 0)
          used *= std::stoi(key.substr(key.find('=') + 1));
      if (n % used != 0) continue;
      keys.push_back("parallel.data=" + std::to_string(n / used));
      keys.push_back("bf16.enabled=true");
      keys.push_back(std::string("comm.payloads=") + (f32 ? "f32" : "auto"));
      Config c = parse_config(kBase, "harness", keys, n);
      RunOptions o;
      o.quiet = true;
      o.parallel = make_parallel_context(
          runtime().world(CommOptions{}),
          GridShape{n, c.parallel.tensor, c.parallel.pipeline, c.parallel.expert});
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
    if (bytes[0] == 0 && bytes[1] == 0) continue;  // the world does not hold this layout
    EXPECT_GT(bytes[0], 0) << k.name;
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
