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

#include <algorithm>
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
#include "loom/kernels/cpu/gemm_backend.h"
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
  // Under context parallelism every rank routes the whole sequences (the
  // routers' logits or ids gathered over the group): the same capacity
  // drops, balancing losses and tag lookbacks as one process.
  const std::string cpn = "parallel.context=" + std::to_string(world);
  data.push_back({"moe, cp, capacity 1.25 (dropping)", {cpn}, moe_drop});
  data.push_back({"moe, cp, bias balancing, zero-2", {cpn, "zero_optimization.stage=2"}, moe_bias});
  data.push_back(
      {"moe, hash router, capacity 1.25, cp, a2a", {cpn, "parallel.context_comm=a2a"}, hash});
  data.push_back({"moe, tag router, cp", {cpn}, tag});
  data.push_back({"moe, cp, ep " + std::to_string(world) + ", capacity 1.25",
                  {cpn, "parallel.expert=" + std::to_string(world)},
                  moe_drop});
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
    data.push_back({"moe, cp 2 x dp 2, ep 2, zero-3",
                    {"parallel.context=2", ep2, "zero_optimization.stage=3"},
                    moe});
    data.push_back({"moe, cp 2 x tp 2, capacity 1.25, sequences split",
                    {"parallel.context=2", "parallel.tensor=2"},
                    moe_drop});
    data.push_back({"moe, ep 2 x pp 2, capacity 1.25, 1f1b, full recompute",
                    {"parallel.pipeline=2", acc4, ep2, "activation_checkpointing.policy=full"},
                    moe_drop});
  }
  // Context parallelism: each sequence in 2 x cp chunks, rank r holding
  // chunks r and 2cp - 1 - r; positions, causal masks and dropout masks
  // keyed on global positions; gradients reduced over dp x cp. The
  // attention merges chunk pairs by log-sum-exp in another order than one
  // process's blocks: reduction order again, inside the default bounds.
  const std::string cpw = "parallel.context=" + std::to_string(world);
  for (const char* comm : {"p2p", "all_gather", "a2a"})
    data.push_back({"cp " + std::to_string(world) + ", " + comm,
                    {cpw, std::string("parallel.context_comm=") + comm}});
  data.push_back({"cp " + std::to_string(world) + ", p2p, zero-3, selective recompute",
                  {cpw, "zero_optimization.stage=3", "activation_checkpointing.policy=selective"}});
  data.push_back({"cp " + std::to_string(world) + ", a2a, zero-1, full recompute, accumulation 2",
                  {cpw, "parallel.context_comm=a2a", "zero_optimization.stage=1",
                   "activation_checkpointing.policy=full", "gradient_accumulation_steps=2"}});
  data.push_back({"cp " + std::to_string(world) + ", contiguous chunks (unbalanced)",
                  {cpw, "parallel.context_balance=false"}});
  if (world == 2)
    data.push_back({"cp 2, every 2nd block recomputed, zero-2",
                    {cpw, "zero_optimization.stage=2", "activation_checkpointing.policy=every_n",
                     "activation_checkpointing.every_n=2"}});
  if (world == 4) {
    data.push_back(
        {"cp 2 x dp 2, p2p, zero-2", {"parallel.context=2", "zero_optimization.stage=2"}});
    data.push_back({"cp 2 x tp 2, p2p", {"parallel.context=2", "parallel.tensor=2"}});
    data.push_back({"cp 2 x tp 2, sequence parallel, a2a",
                    {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                     "parallel.context_comm=a2a"}});
    data.push_back({"cp 2 x tp 2, sequence parallel, all_gather, zero-3",
                    {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
                     "parallel.context_comm=all_gather", "zero_optimization.stage=3"}});
    data.push_back({"cp 2 x pp 2, p2p, 1f1b", {"parallel.context=2", "parallel.pipeline=2", acc4}});
    data.push_back({"cp 2 x pp 2, all_gather, interleaved v 2",
                    {"parallel.context=2", "parallel.pipeline=2", acc4,
                     "parallel.schedule=interleaved", "parallel.virtual_stages=2"}});
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
    // Context parallelism: the key bias's gradient is zero in exact
    // arithmetic (a constant added to a query's every score leaves its
    // softmax alone). One process gets f32 noise; under cp each rank holds
    // part of every query's keys, its partial sum is not zero, and the
    // ranks' partials, rounded to 16 bits before they are reduced, cancel
    // only to a rounding of their size. AdamW turns that noise into moves of
    // up to lr (2e-3) per step on those elements (measured on 4 ranks:
    // 6.5e-3 bf16, 2.1e-3 fp16, every maximum in transformer.h.*.attn.
    // c_attn.bias[C, 2C)); the other bounds are the data-parallel ones.
    Tolerance half_cp = half;
    half_cp.param = bf ? 2e-2 : 1e-2;
    data.push_back({n + ", cp " + std::to_string(world) + ", p2p", {cpw}, on, half_cp});
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
  // bf16 GEMM inputs need a bf16 matmul (kernels.gemm_inputs 16bit is an
  // error on a CPU without one): there those layouts are not run.
  if (!cpu::gemm_16_uses_bf16_matmul(DType::kBF16))
    std::erase_if(data, [](const Layout& l) {
      const auto& m = l.model;
      return l.name.rfind("bf16", 0) == 0 &&
             std::find(m.begin(), m.end(), "kernels.gemm_inputs=16bit") != m.end();
    });
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
  expect_like_one_process({"cp 2 x tp 2 x dp 2, p2p, sequence parallel, zero-2",
                           {"parallel.context=2", "parallel.tensor=2",
                            "parallel.sequence_parallel=true", "zero_optimization.stage=2"}});
  expect_like_one_process(
      {"cp 2 x pp 2 x dp 2, a2a, zero-1",
       {"parallel.context=2", "parallel.pipeline=2", "gradient_accumulation_steps=2",
        "zero_optimization.stage=1", "parallel.context_comm=a2a"}});
}

// An activation budget (policy budget) that keeps two of the model's four
// blocks whole on a rank of the layout `set` gives on n ranks: every block's
// input and the room, plus two blocks' records (at the rank's share of the
// sequence).
size_t two_blocks_whole(const std::vector<std::string>& set, int n) {
  Config c = parse_config(kBase, "harness", set, n);
  GptStage<float> probe(c.model);
  const int64_t B = c.micro_batch, T = c.local_seq_len();
  CheckpointPolicy full;
  full.kind = CheckpointPolicy::kFull;
  probe.set_plan(probe.plan(full, B, T));
  return probe.store_bytes(B, T) + probe.room_bytes(B, T) +
         2 * (probe.block_bytes(B, T, Recompute::kNone) -
              probe.block_bytes(B, T, Recompute::kFull));
}

// Activation checkpointing recomputes in backward what forward computed, with
// the same kernels on the same inputs and the same dropout masks: every
// policy trains bitwise like keeping everything, at every ZeRO stage (stage 3
// gathers a unit again for its recompute pass).
TEST(Checkpointing, PoliciesTrainBitwiseLikeNoneAtEveryZeroStage) {
  const int n = runtime().world_size();
  const std::string dp = "parallel.data=" + std::to_string(n);
  const size_t budget = two_blocks_whole({dp}, n);
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

// Under context parallelism too, every policy recomputes bitwise what
// forward computed: a recomputed attention runs its ring (or all-to-all)
// again over the same keys and values, with the same masks.
TEST(Checkpointing, PoliciesTrainBitwiseLikeNoneUnderContextParallelism) {
  const int n = runtime().world_size();
  const std::string cp = "parallel.context=" + std::to_string(n);
  const size_t budget = two_blocks_whole({cp}, n);
  for (const char* comm : {"p2p", "a2a"}) {
    auto run = [&](std::vector<std::string> policy) {
      policy.insert(policy.end(), {cp, std::string("parallel.context_comm=") + comm,
                                   "train.steps=6", "zero_optimization.stage=2"});
      return train(policy, runtime().world(CommOptions{}));
    };
    const RunResult ref = run({"activation_checkpointing.policy=none"});
    for (const auto& policy : std::vector<std::vector<std::string>>{
             {"activation_checkpointing.policy=full"},
             {"activation_checkpointing.policy=selective"},
             {"activation_checkpointing.policy=every_n", "activation_checkpointing.every_n=3"},
             {"activation_checkpointing.policy=budget",
              "activation_checkpointing.budget_bytes=" + std::to_string(budget)}}) {
      const RunResult got = run(policy);
      EXPECT_EQ(got.losses, ref.losses) << policy[0] << ", " << comm;
      EXPECT_TRUE(got.params == ref.params) << policy[0] << ", " << comm;
    }
    if (runtime().world_rank() == 0)
      std::printf(
          "[ recompute ] cp %d, %s: none, full, selective, every_n, budget bitwise equal over "
          "%zu steps\n",
          n, comm, ref.losses.size());
  }
}

}  // namespace
}  // namespace loom
