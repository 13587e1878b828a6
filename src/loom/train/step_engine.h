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
#include <vector>

#include "loom/comm/parallel_context.h"
#include "loom/data/batch_source.h"
#include "loom/model/gpt_stage.h"
#include "loom/parallel/pipeline/executor.h"
#include "loom/parallel/tensor/regions.h"
#include "loom/parallel/zero/zero.h"
#include "loom/train/config.h"

namespace loom {

struct StepStats {
  double loss = 0;  // mean over the global batch
  double grad_norm = 0;
  double t_forward = 0, t_backward = 0, t_recompute = 0, t_optimizer = 0;  // seconds
  CommStats comm;
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
  // measured on world rank 0 and broadcast (collective then).
  StepEngine(const Config& config, ParallelContext ctx);

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

  // Runs optimizer step `step` (0-based) at learning rate `lr` over the
  // global batch `data` yields for it.
  StepStats step(const BatchSource& data, int64_t step, double lr);
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

 private:
  // The global index of micro-batch `micro`'s first sample: a step's samples
  // are numbered micro-batch by micro-batch, data-parallel rank within each.
  int64_t first_sample(int64_t micro) const;
  void fill(const BatchSource& data, uint64_t step, int64_t sample0, int64_t micro = 0);
  StepStats step_pipelined(const BatchSource& data, int64_t step, double lr);
  double evaluate_pipelined(const BatchSource& data, int64_t batches);
  // The global gradient norm over every chunk, stage and tensor-parallel
  // slice (the tied wte counted once), clipped to config's gradient_clipping.
  double clip_pipelined();
  // The tied wte's gradients summed over the first and last stage.
  void sum_tied_grads();

  struct Chunk {
    std::unique_ptr<GptStage<float>> stage;
    std::unique_ptr<ZeroEngine> zero;
  };

  const Config config_;
  ParallelContext ctx_;
  tp::Group tp_;                                 // the tensor-parallel group (traffic counted)
  std::unique_ptr<LayerFactory<float>> layers_;  // tensor-parallel layers; null: one process's
  PartitionReport partition_;
  std::vector<Chunk> chunks_;
  std::unique_ptr<pp::Executor> executor_;  // null without a pipeline
  StageActivations<float> acts_;            // without a pipeline: one micro-batch in flight
  std::vector<int32_t> inputs_, targets_;   // (micro-batches, B, T)
};

}  // namespace loom
