// loom plan: for a model, a cluster, a GPU count and a global batch, every
// layout (tensor, pipeline, data, context and expert parallel sizes,
// virtual stages, micro-batch, ZeRO stage, recomputation, sequence
// parallelism, precision, schedule), its memory per device by category and
// its step time, the ones that do not fit pruned, the rest ranked by
// tokens/s. The model is analytic (docs/plan.md):
//
// memory   parameters, gradients and optimizer state by the ZeRO paper's
//          formulas (2 + 2 + K bytes a parameter, K = 12 for Adam in mixed
//          precision; 4 + 4 + 8 in f32), sharded by stage over the data-
//          parallel ranks; activations per layer by Korthikanti et al.'s
//          counts (sbh(10 + 24/t + 5as/ht) bytes in 16 bits, 34/t with
//          sequence parallelism, 2sbh kept under full recomputation) times
//          the micro-batches the schedule holds on its first stage;
// time     each GEMM at the device's peak times an efficiency that grows
//          with its size, the memory-bound rest at memory bandwidth, each
//          collective by an alpha-beta model of the link it crosses (inside
//          a node or between nodes), the pipeline's bubble by its schedule,
//          the data-parallel traffic by ZeRO stage, exposed where it
//          outlasts the backward it overlaps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/comm/algorithms/allreduce.h"
#include "loom/plan/cluster.h"

namespace loom::plan {

// The model's shape (a loom config's `model` section).
struct ModelShape {
  int64_t n_layer = 0, hidden = 0, heads = 0, vocab = 0, seq = 0;
  int64_t experts = 0, top_k = 0, moe_every = 1;  // experts 0: dense
  double capacity = 0;                            // model.moe.capacity_factor (0: no dropping)
  bool learned_router = true;                     // model.moe.router learned (logits kept)
  double params() const;                          // the whole model's
};
// From a loom config, or its `model` section alone.
ModelShape parse_model(const nlohmann::json& j, const std::string& source);

struct Layout {
  int tp = 1, pp = 1, dp = 1, cp = 1, ep = 1, v = 1;
  int64_t micro = 1;
  int zero = 1;
  std::string recompute = "none";  // none, selective, full
  bool sp = false;
  std::string precision = "bf16";  // bf16, fp16, f32
  std::string schedule = "1f1b";   // 1f1b, gpipe, interleaved, zero_bubble
  int gpus() const { return tp * pp * dp * cp; }
  std::string describe() const;  // "tp=8,pp=4,dp=32,..." as --layout takes it
};

// The keys --layout fixes (the others are searched).
struct LayoutConstraint {
  Layout values;
  std::vector<std::string> fixed;  // key names
  bool has(const std::string& key) const;
};
// "tp=8,pp=35,micro=1,recompute=full" (Error(kConfig) naming a bad key or value).
LayoutConstraint parse_layout(const std::string& text);

struct MemoryBytes {
  double params = 0, grads = 0, optimizer = 0, activations = 0, comm = 0, workspace = 0;
  double total() const { return params + grads + optimizer + activations + comm + workspace; }
};

struct Estimate {
  Layout layout;
  MemoryBytes mem;  // the most loaded device (a pipeline's first or last stage)
  bool fits = false;
  // Seconds per step: the pipeline's compute (with its own TP and CP
  // communication), the bubble, point-to-point messages, the exposed
  // data-parallel reduction, the optimizer.
  double step_s = 0, compute_s = 0, bubble_s = 0, p2p_s = 0, dp_exposed_s = 0, optimizer_s = 0;
  double tp_comm_s = 0;  // of compute_s, tensor- and context-parallel collectives
  double tokens_per_s = 0;
  double tflops_per_gpu = 0;     // model FLOPs (3 x forward) per device per second
  double hw_tflops_per_gpu = 0;  // counting the recomputed forward too
};

// What runs the layout, as far as the model needs to know. `loom`: model
// states as model_states() counts them; gradients reduced in the run's
// precision, all-reduced beside the last micro-batch's backward (stages
// 0-1) or reduce-scattered beside every micro-batch's (stages 2-3), the
// updated parameters all-gathered after the step (stages 1-2); every
// schedule; context parallelism (2 x cp chunks of each sequence); no
// sequence parallelism with experts.
// `megatron-2021` (the engine of Megatron-LM's published 2021 runs): fp16
// parameters with fp32 gradients, masters and moments (18 bytes a
// parameter), fp32 gradients all-reduced after the backward, no ZeRO, the
// 1F1B schedule and the interleaved one from pp 3, no sequence parallelism.
struct Engine {
  std::string name = "loom";
  double state_bytes_16 = 16;  // bytes of model state a parameter, 16-bit runs
  double grad_wire_bytes = 0;  // bytes a gradient crosses the wire as (0: the run's precision)
  bool dp_overlap = true;
  bool zero_bubble = true, gpipe = true, sequence_parallel = true;
  bool sequence_parallel_moe = false;  // sequence parallelism with expert layers
  bool context_parallel = true;
  int interleave_min_pp = 2;  // the interleaved schedule from this many stages
  int max_zero = 3;
  // Activations, scratch and communication buffers as loom's executor
  // sizes them (loom_memory.h); else Korthikanti et al.'s 16-bit counts.
  bool executor_memory = true;
  // Pipeline messages posted ahead and sent without blocking, so that they
  // cross beside the compute (loom's executor); else every message of the
  // critical path waits (Megatron-LM 2021's blocking exchanges).
  bool p2p_overlap = true;
  // Messages a pipeline step may tag (2 x micro-batches x chunks below it,
  // the executor's point-to-point tags; 0: no limit).
  int64_t pipeline_tags = algo::kAlgoTagBase;
};
Engine engine_named(const std::string& name);  // Error(kConfig) naming the choices

// The model states of Ψ parameters on a device (the ZeRO paper, Rajbhandari
// et al. 2020): 16-bit parameters and gradients (2 + 2 bytes) and K = 12
// bytes of Adam state (f32 masters, both moments); in f32 4 + 4 + 8.
// Stage 1 divides the optimizer state by the data-parallel ranks, stage 2
// the gradients as well, stage 3 the parameters too.
MemoryBytes model_states(double psi, const std::string& precision, int zero, int dp);

// Model FLOPs of one step (forward and backward, 72 B s l h^2 (1 + s/6h +
// V/12lh) for a dense GPT); with full recomputation the executed ones
// (96 B s l h^2 (1 + s/6h + V/16lh), Narayanan et al.'s count).
double step_flops(const ModelShape& m, int64_t batch, bool with_recompute);

// Why the layout cannot run the model and batch on the engine (a size that
// does not divide, a feature the engine lacks), or "" when it can.
std::string invalid_reason(const ModelShape& m, int64_t batch, const Layout& l,
                           const Engine& engine);

// Seconds of block `layer`'s forward GEMMs (projections, MLP or experts,
// attention's two products) on one device of `c` under `l`; backward runs
// twice as many. --calibrate solves the elementwise rate from a measured
// block with it.
double layer_gemm_s(const ModelShape& m, const ClusterSpec& c, const Layout& l, int64_t layer);

// One layout's memory and time; Error(kConfig) when the layout is not valid
// (invalid_reason(), after the layout).
Estimate estimate(const ModelShape& m, const ClusterSpec& c, int64_t batch, const Layout& l,
                  const Engine& engine = {});

struct PlanOptions {
  int gpus = 0;
  int64_t batch = 0;  // global batch, sequences
  LayoutConstraint constraint;
  int top = 10;
  Engine engine;
};

// Every valid layout that fits, best tokens/s first (at most `top`).
// Error(kConfig) when no layout divides the GPU count (saying why) or none
// fits (saying by how much the smallest misses).
std::vector<Estimate> search(const ModelShape& m, const ClusterSpec& c, const PlanOptions& o);
// How many valid layouts search() estimated in its last call (for the summary).
int64_t layouts_considered();

nlohmann::json to_json(const Estimate& e);

}  // namespace loom::plan
