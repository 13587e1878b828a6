// One optimizer step over this rank's part of the model: the micro-batch
// schedule, gradient synchronisation through the ZeRO engines (which reach
// the model only through its parameter stores), clipping and the optimizer.
// Without a pipeline the rank holds the whole model as one stage and feeds
// it micro-batch by micro-batch (forward then backward, one in flight); with
// one it holds a chunk per virtual stage and the pipeline executor runs the
// schedule's list for its stage. Everything that communicates gets its group
// from the ParallelContext passed in; nothing is global.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/parallel_context.h"
#include "loom/data/batch_source.h"
#include "loom/model/gpt_stage.h"
#include "loom/optim/loss_scaler.h"
#include "loom/parallel/context/context_attention.h"
#include "loom/parallel/expert/all_to_all.h"
#include "loom/parallel/pipeline/executor.h"
#include "loom/parallel/tensor/regions.h"
#include "loom/parallel/zero/zero.h"
#include "loom/train/config.h"
#include "loom/train/metrics.h"

namespace loom {

struct StepStats {
  double loss = 0;  // mean over the global batch
  double grad_norm = 0;
  bool skipped = false;   // non-finite gradients (skip, or an fp16 overflow): no update
  double loss_scale = 1;  // fp16: the scale this step's backward ran with
  std::string nonfinite;  // skipped: the first parameter in model order with one
  std::vector<MoeLayerStats> moe;
  double t_forward = 0, t_backward = 0, t_recompute = 0, t_optimizer = 0;  // seconds
  CommStats comm;
  CompressionStats compression;  // comm.compression, over the rank's chunks
  // Expert parallelism: seconds of the MoE layers' all-to-alls
  // (also in comm; they block the layers, so all of it is exposed).
  double t_all_to_all = 0;
  // Context parallelism: seconds in the attention kernels and in the
  // keys' and values' collectives (also in comm), and their exposed part.
  double t_context_attention = 0, t_context_comm = 0, t_context_exposed = 0;
  int64_t context_sent_bytes = 0;
  // Pipelined: over the pipeline's span (the first rank's start to the last
  // rank's last compute), the most idle rank's seconds without compute, the
  // mean idle share over the ranks; and this rank's seconds blocked on
  // messages.
  double t_bubble = 0, bubble_fraction = 0, t_p2p_wait = 0;
};

// How the blocks were cut into pipeline parts, and what each part costs
// (measured for `balanced`; empty otherwise).
struct PartitionReport {
  std::vector<int> counts;
  std::string table;
};

class StepEngine {
 public:
  // Builds this rank's stage chunks for `ctx` (the whole model without a
  // pipeline; their layers split over the context's tensor-parallel group),
  // their ZeRO engines over the data-parallel group, and their
  // recomputation plans; initialises nothing. A balanced partition is
  // measured on world rank 0 and broadcast (collective then). Every stage
  // computes on `backend`, which must outlive the engine.
  StepEngine(const Config& config, ParallelContext ctx, const Backend<float>& backend);
  const Backend<float>& backend() const { return backend_; }

  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  GptStage<float>& stage(int chunk = 0) { return *chunks_[static_cast<size_t>(chunk)].stage; }
  ZeroEngine& zero(int chunk = 0) { return *chunks_[static_cast<size_t>(chunk)].zero; }
  const ParallelContext& context() const { return ctx_; }
  const Config& config() const { return config_; }
  bool pipelined() const { return executor_ != nullptr; }
  const PartitionReport& partition() const { return partition_; }
  // The last pipelined step's instructions as they ran (log.trace), in
  // seconds from one origin the ranks took together when the engine was built.
  const std::vector<pp::TraceSlice>& trace() const;
  // The ranks' common time origin, on comm_clock() (taken after a barrier
  // when the engine was built).
  double time_origin() const { return origin_s_; }

  // Runs optimizer step `step` (0-based) at learning rate `lr` over the
  // global batch `data` yields for it. When a gradient holds a non-finite
  // value (any rank's: the global norm is not finite), train.on_nonfinite
  // decides: `stop` throws naming the first such parameter in model order
  // (the same message on every rank), `skip` leaves parameters and moments
  // as they were and counts the step (AdamW's bias correction counts
  // updates made, as DeepSpeed's does). In fp16 the backward runs on the
  // loss times the loss scale, and a non-finite norm is an overflow: the
  // step is skipped and counted and the scaler moves (whatever
  // on_nonfinite says), until an overflow at the minimum scale throws.
  StepStats step(const BatchSource& data, int64_t step, double lr);
  int64_t skipped_steps() const { return skipped_; }
  // fp16: the dynamic loss scaler (null in f32 and bf16).
  LossScaler* loss_scaler() { return scaler_.get(); }
  void set_skipped_steps(int64_t n) { skipped_ = n; }
  // Mean loss over `batches` global batches of step 0 (the same samples
  // under every layout; every rank runs the same number of forwards).
  double evaluate(const BatchSource& data, int64_t batches);
  // The whole flat parameter buffer of chunk 0 (gathered from the shards at
  // ZeRO stage 3: collective, every rank must call it).
  std::vector<float> gather_params();
  // The model's FLOPs per token for training (all of it, whatever this rank holds).
  double flops_per_token() const { return chunks_[0].stage->flops_per_token(); }
  // The peak bytes of each memory category, maximum over the ranks
  // (collective).
  MemStats peak_memory_over_ranks();
  // Throws Error(kData) naming the first parameter replicated over the
  // tensor-parallel group whose copies are not bitwise equal. Collective
  // over the tensor-parallel group; run at every checkpoint and, with
  // comm.debug, every step.
  void check_replicas();

 private:
  // The global index of micro-batch `micro`'s first sample: a step's samples
  // are numbered micro-batch by micro-batch, data-parallel rank within each.
  int64_t first_sample(int64_t micro) const;
  void fill(const BatchSource& data, uint64_t step, int64_t sample0, int64_t micro = 0);
  StepStats step_pipelined(const BatchSource& data, int64_t step, double lr);
  double evaluate_pipelined(const BatchSource& data, int64_t batches);
  // The global gradient norm over every chunk, stage and tensor-parallel
  // slice (the tied wte counted once; global_grad_norm), agreed over the job
  // and clipped to config's gradient_clipping. Both step paths use it.
  double clip_global();
  // The norm every rank uses: world rank 0's, or a non-finite one if any
  // rank's is (collective over the world).
  double agree_norm(double norm) const;
  // The tied wte's gradients summed over the first and last stage.
  void sum_tied_grads();
  // Under a MoE row split (moe_split_), the routers' and experts' gradients
  // summed over the tensor-parallel group: each rank's hold its tokens only.
  void sum_split_moe_grads();
  // Every MoE layer's load over the step, from every rank (collective over
  // the world when the model has MoE layers); drop_moe_stats() forgets what
  // came before (evaluation's forwards, their all-to-alls too).
  // With bias balancing and `update`, each MoE layer's bias moves by
  // bias_update_rate towards equal loads (sign of mean - load, per expert),
  // in whatever part of it this rank holds, before the optimizer step.
  std::vector<MoeLayerStats> moe_stats(bool update = false);
  void drop_moe_stats();
  // The all-to-alls since the last call into r (its comm too).
  void take_all_to_all(StepStats& r);
  // The context-parallel attention's collectives and kernel time into r.
  void take_context(StepStats& r);
  // Every chunk's comm.compression stats of the step into r.
  // Whether training step `step` (1-based) must leave every data-parallel
  // rank's parameters equal: the steps the trainer evaluates, checkpoints
  // or ends at (0/1 Adam's local steps synchronise there).
  bool settles(int64_t step) const;
  void take_compression(StepStats& r);
  // After the gradient norm of step `step` (0-based): whether to update.
  // Throws (train.on_nonfinite stop) or counts a skip when `norm` is not
  // finite. Collective over the world when it is not.
  bool accept_update(int64_t step, double norm, std::string* name);
  // The first parameter, in the whole model's order, whose reduced gradient
  // holds a non-finite value on any rank (collective over the world); ""
  // when none does.
  std::string first_nonfinite_param();
  // Tests only: LOOM_TEST_NONFINITE=STEPS:NAME puts a NaN into parameter
  // NAME's reduced gradient at each step of STEPS (1-based, comma-separated),
  // where this rank holds it.
  void inject_nonfinite(int64_t step);
  // Tests only: LOOM_TEST_GRAD_SCALE=NAME:FACTOR multiplies parameter NAME's
  // reduced gradient by FACTOR at every step, where this rank holds it: a
  // layout made wrong on purpose, for the harness to catch.
  void inject_grad_scale();

  struct Chunk {
    std::unique_ptr<GptStage<float>> stage;
    std::unique_ptr<ZeroEngine> zero;
  };
  int64_t skipped_ = 0;  // steps whose update was skipped
  // fp16: backward runs on the loss times its scale; the gradients are
  // divided by it before the norm; an overflow skips the step.
  std::unique_ptr<LossScaler> scaler_;

  const Config config_;
  ParallelContext ctx_;
  const Backend<float>& backend_;
  double origin_s_ = 0;
  tp::Group tp_;                                     // the tensor-parallel group (traffic counted)
  std::shared_ptr<ep::AllToAllDispatcher> experts_;  // expert parallelism; null: none
  std::shared_ptr<context::ContextAttention> context_;  // context parallelism; null: none
  bool moe_split_ = false;                       // tensor ranks split the MoE layers' sequences
  std::unique_ptr<LayerFactory<float>> layers_;  // parallel layers; null: one process's
  PartitionReport partition_;
  std::vector<Chunk> chunks_;
  std::unique_ptr<pp::Executor> executor_;  // null without a pipeline
  StageActivations<float> acts_;            // without a pipeline: one micro-batch in flight
  std::vector<int32_t> inputs_, targets_;   // (micro-batches, B, T)
};

}  // namespace loom
