// Data parallelism with ZeRO stages 0-3 for one model replica per rank.
//
//   stage 0  full parameters, gradients and moments; gradients averaged by
//            bucketed all-reduce during the last micro-batch's backward.
//   stage 1  moments of the shard only; the same all-reduce; each rank
//            updates its slices and the units are all-gathered in place.
//   stage 2  also gradients: each unit's gradients are reduce-scattered into
//            the shard as soon as backward is done with it (every micro-batch).
//   stage 3  also parameters: only the shard is kept; each use of a unit in
//            forward or backward gathers it first and releases it after.
//
// The engine is the glue of its parts, each in its own file:
//   shard_layout.h     how units split into this rank's slices and shard;
//   grad_reducer.h     the gradient reduction strategy (bucketed all-reduce,
//                      per-unit reduce-scatter);
//   param_gather.h     stage 3's gathering with prefetch;
//   shard_optimizer.h  the optimizer state, in memory or offloaded to NVMe;
//   zero_state.cc      the views and gathers checkpoints and tools use.
// This file's engine drives them from the model's unit hooks, keeps the
// mixed-precision working copies and computes the global gradient norm.
//
// 16-bit mode (ZeroConfig::dtype bf16 or f16, from bf16.enabled /
// fp16.enabled): the engine keeps the parameters and the gradients in 16
// bits, where the stage says (the whole layout or this rank's slices), and
// f32 master weights sharded like the moments: 2 + 2 + 12 bytes of model
// state per parameter. The layers still compute in f32: each use of a unit
// widens its 16-bit parameters (gathered first at stage 3) once into an f32
// working copy that lives while the unit is in use (uses in a row share
// it), and the reducer takes the unit's f32 gradients into the 16-bit ones
// (grad_reducer.h). The all-reduce of stages 0-1 and every parameter
// all-gather move 16-bit elements. Clipping and the loss scale's inverse
// become one factor on the gradients that the step applies; the step
// updates the masters and rounds them into the parameters. Checkpoints read
// and write the masters.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/nn/param_store.h"
#include "loom/optim/adamw.h"
#include "loom/parallel/zero/comm_wait.h"
#include "loom/parallel/zero/grad_reducer.h"
#include "loom/parallel/zero/onebit.h"
#include "loom/parallel/zero/param_gather.h"
#include "loom/parallel/zero/shard_layout.h"
#include "loom/parallel/zero/shard_optimizer.h"
#include "loom/parallel/zero/zero_config.h"

namespace loom {

class ZeroEngine {
 public:
  // How to build the model for `config` on `world` data-parallel ranks.
  static StoreOptions storage(const ZeroConfig& config, int world);

  // group: the data-parallel group, or null for one process. The store must
  // have been built with storage(config, group size). The engine reaches the
  // model only through the store: its unit ranges, buffers and hooks.
  ZeroEngine(ParamStore<float>& store, std::shared_ptr<ProcessGroup> group,
             const ZeroConfig& config, const OptimizerConfig& optimizer, ExpertGroups experts = {});
  ~ZeroEngine();

  int stage() const { return config_.stage; }
  // Elements of this rank's shard (the whole layout when unsharded).
  int64_t shard_elements() const { return shards_.shard_elements(); }

  // Initialises the parameters this rank holds from the seed.
  void init_params(uint64_t seed);
  void zero_grads();
  // Before a micro-batch's forward: the unit uses the model will make
  // (GptStage::unit_schedule; with backward passes when a backward follows),
  // `last` if it is the step's last micro-batch (stages 0-1 reduce
  // gradients only then).
  void begin_micro_batch(std::vector<UnitUse> schedule, bool last);
  // After the micro-batch's backward (or forward alone): waits for its
  // gradient reductions.
  void end_micro_batch();
  // Scales the gradients by max_norm / norm when norm > max_norm > 0.
  void clip_grads(double norm, double max_norm);
  // The reduced gradients of the whole part (laid out like its flat
  // parameters, padding zero), as the optimizer will use them: gathered
  // from the shards at stages 2-3 (collective over each unit's group),
  // widened in 16-bit mode. For tests and tools; allocates.
  std::vector<float> gather_grads();
  // This rank's sums of squares of the reduced gradients, {parameters split
  // over the tensor-parallel group, whole ones}, added over the data-parallel
  // group when sharded (collective over it then), leaving out unit `skip` (a
  // copy counted elsewhere; -1: none). The pieces of global_grad_norm.
  std::pair<double, double> grad_sum_squares(int skip = -1);
  void scale_grads(float scale);
  // Adds unit u's first n reduced gradient elements over `group`, whose
  // members hold the same parameters at the same place of an equal-sized
  // unit (the tied wte of the first and last pipeline stage). Collective.
  void sum_unit_grads(int u, int64_t n, ProcessGroup& group);
  // Adds the reduced gradients of flat range [begin, end) that this rank
  // holds over `group`, whose members hold the same layout and the same
  // slices of it. Collective.
  void sum_grads(int64_t begin, int64_t end, ProcessGroup& group);
  // AdamW on this rank's shard, then whatever gathering the stage needs.
  // `sync`: the step must leave every data-parallel rank's parameters
  // equal (0/1 Adam's local steps synchronise; nothing else changes).
  void step(double lr, int64_t step, bool sync = false);
  // After a skipped step where the parameters must be every rank's again:
  // 0/1 Adam's open local interval synchronised (nothing else to do).
  void settle();
  // Communication since the last call.
  CommStats take_stats();
  // comm.compression: what it did since the last call, the state it
  // carries between steps (for checkpoints), and the steps reduced so far
  // (a resume sets them).
  CompressionStats take_compression();
  std::vector<CompressionState> compression_state();
  // A resume: `steps` reductions (the run's steps) and `optimizer_steps`
  // updates (those not skipped) done so far.
  void resume_steps(int64_t steps, int64_t optimizer_steps);

  // Stage 3: gathers the full parameters into the model's own buffer
  // (collective); release_full_params(true) copies this rank's slices back
  // into the shard first (after loading weights). No-ops at stages 0-2 in
  // f32. In 16-bit mode, at every stage: the f32 masters gathered (collective
  // when they are sharded, stages 1-3), and release_full_params(true) takes
  // this rank's slices back into the masters and calls sync_params().
  void gather_full_params();
  void release_full_params(bool keep_changes);
  bool full_params_gathered() const { return full_; }
  // The moments laid out like the whole flat buffer (collective when sharded).
  void gather_moments(std::vector<float>& m, std::vector<float>& v);
  // Takes this rank's slices of whole-layout moments.
  void load_moments(const float* m, const float* v);
  // The model state a checkpoint writes and reads, as flat ranges of the
  // layout with where this rank keeps their elements.
  // kGrads: the reduced gradients (held() only).
  enum class State { kParams, kExpAvg, kExpAvgSq, kGrads };
  struct StateRange {
    int64_t begin = 0, end = 0;
    float* data = nullptr;  // elements [begin, end)
    // 16-bit mode, kGrads: the 16-bit gradients instead (data is null).
    uint16_t* data16 = nullptr;
  };
  // Every range of `s` this rank holds: whole units where it is not
  // sharded, this rank's slices where it is. What a resume fills.
  std::vector<StateRange> held(State s) const;
  // This rank's share of every unit: its slices when the state is sharded,
  // else (every rank holds it all) an equal part of each unit, so the
  // data-parallel ranks share the writing. What a save writes.
  std::vector<StateRange> share(State s) const;
  // 16-bit mode: sets the 16-bit parameters to the masters rounded, after
  // the masters were written from outside (a checkpoint loaded through
  // held(kParams)). Collective over the data-parallel group at stages 1-2.
  // A no-op in f32.
  void sync_params();
  // The storage type of parameters and gradients (kF32 unless 16-bit mode).
  DType dtype() const { return config_.dtype; }
  // Drops the offloaded moments' pages after a checkpoint touched them.
  void release_offloaded();
  // Optimizer bytes resident in memory now (the file mapping with nvme).
  size_t optimizer_resident_bytes() const;
  size_t max_gathered_elements() const { return gatherer_ ? gatherer_->peak_elements() : 0; }
  // The GEMMs' blocked copies of the 16-bit matrices (kParams in the memory
  // tracker): weights16 below stage 3 on a CPU whose bf16 matmul runs.
  size_t weight_pack_bytes() const { return packs_ ? packs_->bytes() : 0; }

 private:
  int num_units() const { return shards_.num_units(); }
  const Unit& unit(int u) const { return shards_.unit(u); }
  void on_before(int u, Pass pass);
  void on_after(int u, Pass pass);
  bool half() const { return config_.dtype != DType::kF32; }
  // Bytes of n elements of the parameter and gradient storage type.
  size_t pbytes(int64_t elements) const;
  float* shard_params() const { return param_shard_.as<float>(); }
  float* shard_grads() const { return grad_shard_.as<float>(); }
  uint16_t* params16() const { return p16_.as<uint16_t>(); }
  uint16_t* grads16() const { return g16_.as<uint16_t>(); }
  float* masters() const { return optimizer_->masters(); }
  // The reduced f32 gradients this rank holds (whole below stage 2).
  float* held_grads() const { return config_.stage >= 2 ? shard_grads() : store_.grads(); }
  // Binds unit u's parameters for a use: gathered first at stage 3 and, in
  // 16-bit mode, widened once into its working copy (uses in a row keep it).
  void bind_for_use(int u);
  void release_for_use(int u);
  // Stages 1-2: all-gathers every unit's updated slices into the full parameters.
  void gather_updated_params();
  // Sums of squares of this rank's gradients: of split parameters, of whole
  // ones (experts' added over the expert-parallel group when they are not
  // sharded: collective over it then).
  std::pair<double, double> split_sum_squares(int skip);

  ParamStore<float>& store_;
  const Backend<float>& be_;  // the store's: every buffer and operation of the engine
  std::shared_ptr<ProcessGroup> group_;
  ZeroConfig config_;
  ExpertGroups experts_;
  int rank_ = 0, world_ = 1;  // in the data-parallel group
  ShardLayout shards_;
  std::unique_ptr<ShardOptimizer> optimizer_;
  Buffer param_shard_, grad_shard_;  // f32: stage 3 / stages 2-3
  // 16-bit mode: parameters (whole layout, or the shard at stage 3) and
  // gradients (whole, or the shard from stage 2); per unit in use its f32
  // working copy (with weights16 only the unit's parameters that are not
  // matrices, and src16_ where its 16-bit parameters are read).
  Buffer p16_, g16_;
  std::vector<Buffer> work_;
  std::vector<const uint16_t*> src16_;
  // weights16 below stage 3: the GEMMs' own layouts of the 16-bit matrices,
  // cleared whenever p16_ is written (at stage 3 a unit's gathered copy
  // lives one use, so the GEMMs lay it out per use).
  std::unique_ptr<WeightPacks> packs_;
  float grad_factor_ = 1;  // 16-bit mode: clipping and 1 / loss scale, applied at the step
  // After the buffers they write into, so that they are gone first.
  std::unique_ptr<GradReducer> reducer_;
  std::unique_ptr<ParamGatherer> gatherer_;  // stage 3
  std::unique_ptr<OneBitAdam> onebit_;       // optimizer.type OneBitAdam
  int64_t optimizer_steps_ = 0;              // updates done (the last step() argument)

  // The unit uses of the current micro-batch and the position in them.
  std::vector<UnitUse> plan_;
  size_t pos_ = 0;
  bool full_ = false;  // full parameters gathered into the model (gather_full_params)
  CommStats stats_;
};

// One part of a model for global_grad_norm: an engine and the unit it
// leaves out (-1: none; the tied wte copy of a pipeline's last stage).
struct NormPart {
  ZeroEngine* zero;
  int skip = -1;
};

// The global L2 norm of the reduced gradients of a model whose part on this
// rank `parts` hold (one engine, or a pipeline stage's chunks): parameters
// split over the tensor-parallel group `tp` add their slices' squares over
// it, the others, replicated on every rank of it, count once (rank 0's);
// then the pipeline's stages `pp` add, in stage order on every rank.
// Collective over tp, pp (either null: none) and, where sharded, each
// part's data-parallel group. The caller agrees on one value over the job
// before clipping with it.
double global_grad_norm(const std::vector<NormPart>& parts, ProcessGroup* tp, ProcessGroup* pp);

}  // namespace loom
