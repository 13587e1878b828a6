// How a job's blocks are cut into pipeline parts (parallel.partition), with
// the measurement `balanced` needs: each layer's forward + backward time and
// activation memory on this machine for one micro-batch.
#pragma once

#include "loom/comm/parallel_context.h"
#include "loom/kernels/backend.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/parallel/pipeline/schedule.h"
#include "loom/train/config.h"

namespace loom {

struct PartitionReport;

// The layer counts of the pipeline x virtual_stages parts. `balanced`
// measures on world rank 0 and broadcasts the cut (collective over the
// world then), so every rank builds the same stages.
// `sim` is the run's schedule simulated (null without a pipeline): each
// part's activation stores held at once.
PartitionReport resolve_partition(const Config& config, const ParallelContext& ctx,
                                  const Backend<float>& backend, const pp::SimResult* sim);

// One micro-batch of (B, T) through the embedding, a block and the head, in
// one process on `backend` (the run's): seconds (median of `reps`) and bytes,
// the records kept in `records` (a 16-bit run's type packs them).
pp::ModelCosts measure_model_costs(const GptConfig& model, int64_t B, int64_t Tn, int reps = 3,
                                   DType records = DType::kF32,
                                   const Backend<float>& backend = default_backend<float>());

}  // namespace loom
