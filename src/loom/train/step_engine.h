// One optimizer step over a stage: the micro-batch schedule (forward then
// backward, one micro-batch in flight), gradient synchronisation through the
// ZeRO engine (which reaches the model only through its parameter store),
// clipping and the optimizer. Everything that communicates gets its group
// from the ParallelContext passed in; nothing is global.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/comm/parallel_context.h"
#include "loom/data/batch_source.h"
#include "loom/model/gpt_stage.h"
#include "loom/parallel/tensor/regions.h"
#include "loom/parallel/zero/zero.h"
#include "loom/train/config.h"

namespace loom {

struct StepStats {
  double loss = 0;  // mean over the global batch
  double grad_norm = 0;
  double t_forward = 0, t_backward = 0, t_recompute = 0, t_optimizer = 0;  // seconds
  CommStats comm;
};

class StepEngine {
 public:
  // Builds the stage for `ctx` (the whole model while there is no pipeline;
  // its layers split over the context's tensor-parallel group), its ZeRO
  // engine over the data-parallel group, and its recomputation plan;
  // initialises nothing.
  StepEngine(const Config& config, ParallelContext ctx);

  GptStage<float>& stage() { return stage_; }
  ZeroEngine& zero() { return *zero_; }
  const ParallelContext& context() const { return ctx_; }

  // Runs optimizer step `step` (0-based) at learning rate `lr` over the
  // global batch `data` yields for it.
  StepStats step(const BatchSource& data, int64_t step, double lr);
  // Mean loss over `batches` global batches of step 0 (the same samples
  // under every layout; every rank runs the same number of forwards).
  double evaluate(const BatchSource& data, int64_t batches);
  // The whole flat parameter buffer (gathered from the shards at ZeRO
  // stage 3: collective, every rank must call it).
  std::vector<float> gather_params();
  // The peak bytes of each memory category, maximum over the ranks
  // (collective).
  MemStats peak_memory_over_ranks();

 private:
  // The global index of micro-batch `micro`'s first sample: a step's samples
  // are numbered micro-batch by micro-batch, data-parallel rank within each.
  int64_t first_sample(int64_t micro) const;
  void fill(const BatchSource& data, uint64_t step, int64_t sample0);

  const Config config_;
  ParallelContext ctx_;
  tp::Group tp_;                                 // the tensor-parallel group (traffic counted)
  std::unique_ptr<LayerFactory<float>> layers_;  // tensor-parallel layers; null: one process's
  GptStage<float> stage_;
  std::unique_ptr<ZeroEngine> zero_;
  StageActivations<float> acts_;  // one micro-batch in flight
  std::vector<int32_t> inputs_, targets_;
};

}  // namespace loom
