// Data parallelism with ZeRO stages 0-3 for one model replica per rank.
//
// Sharding is by unit (ParamLayout): every unit's flat range splits into one
// equal slice per rank of the group it is reduced over (the data-parallel
// group; for expert units under expert parallelism, the ranks holding the
// same experts), and a rank's shard is its slices of all units, kept
// contiguous. So a unit's full parameters are one all-gather of the ranks'
// slices, and its gradients one reduce-scatter into them.
//
//   stage 0  full parameters, gradients and moments; gradients averaged by
//            bucketed all-reduce during the last micro-batch's backward.
//   stage 1  moments of the shard only; the same all-reduce; each rank
//            updates its slices and the units are all-gathered in place.
//   stage 2  also gradients: backward writes each unit's gradients into a
//            unit-sized buffer, reduce-scattered into the shard's gradients
//            as soon as backward is done with the unit (every micro-batch).
//   stage 3  also parameters: only the shard is kept; each use of a unit in
//            forward or backward gathers it first (prefetched ahead along the
//            model's unit schedule) and releases it after.
//
// The buffers of stages 2-3 (gathered units, unit gradients being reduced)
// are counted under the memory category `comm`, apart from model state.
//
// 16-bit mode (ZeroConfig::dtype bf16 or f16, from bf16.enabled /
// fp16.enabled): the engine keeps the parameters and the gradients in 16
// bits, where the stage says (the whole layout or this rank's slices), and
// f32 master weights sharded like the moments: 2 + 2 + 12 bytes of model
// state per parameter. The layers still compute in f32: each use of a unit
// widens its 16-bit parameters (gathered first at stage 3) into an f32
// working copy that lives while the unit is in use, and backward writes a
// unit's gradients into an f32 buffer that, once backward is done with the
// unit, is added into the 16-bit gradients (stages 0-1) or rounded and
// reduce-scattered in 16 bits (stages 2-3; the collective accumulates in
// f32). The all-reduce of stages 0-1 and every parameter all-gather move
// 16-bit elements. Clipping and the loss scale's inverse become one factor
// on the gradients that the step applies; the step updates the masters and
// rounds them into the parameters. Checkpoints read and write the masters.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/nn/param_store.h"
#include "loom/optim/adamw.h"
#include "loom/parallel/data/grad_buckets.h"
#include "loom/parallel/zero/offload.h"
#include "loom/parallel/zero/zero_config.h"

namespace loom {

struct CommStats {
  double comm_s = 0;     // time the collectives took on the communication thread
  double exposed_s = 0;  // time the caller waited for them
};

// Expert parallelism (parallel.expert > 1): the expert units (Unit::expert)
// hold this rank's experts, which the ranks of the expert-parallel group
// `ep` split between them; `ep_dp` (null: this rank alone) is the
// data-parallel ranks holding the same experts. Expert gradients are
// averaged over ep_dp and divided by ep (so they carry every data-parallel
// rank's tokens at 1 / dp, as dense gradients do), their ZeRO shards split
// over ep_dp, and gradient norms add the ep ranks' experts.
struct ExpertGroups {
  std::shared_ptr<ProcessGroup> ep, ep_dp;
  int ep_size() const { return ep ? ep->size() : 1; }
};

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
  int64_t shard_elements() const { return shard_elements_; }

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
  // The global L2 norm of the averaged gradients this engine's model part
  // holds (collective over the data-parallel group when sharded, and the
  // tensor-parallel group). With a tensor-parallel group the parameters
  // split over it (ShardSpec) add their slices' squares over the group; the
  // others, replicated on every rank of it, count once (rank 0's). The
  // trainer agrees on one value over the job before clipping with it.
  double grad_norm();
  // Scales the gradients by max_norm / norm when norm > max_norm > 0.
  void clip_grads(double norm, double max_norm);
  void set_tensor_parallel(std::shared_ptr<ProcessGroup> tp) { tp_ = std::move(tp); }
  // The reduced gradients of the whole part (laid out like its flat
  // parameters, padding zero), as the optimizer will use them: gathered
  // from the shards at stages 2-3 (collective over each unit's group),
  // widened in 16-bit mode. For tests and tools; allocates.
  std::vector<float> gather_grads();
  // The pieces of grad_norm for a model split over several engines (a
  // pipeline's stages and chunks): this rank's sums of squares of the
  // reduced gradients, {parameters split over the tensor-parallel group,
  // whole ones}, added over the data-parallel group when sharded (collective
  // over it then), leaving out unit `skip` (a copy counted elsewhere; -1:
  // none); and scaling every gradient this rank holds.
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
  void step(double lr, int64_t step);
  // Communication since the last call.
  CommStats take_stats();

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
  size_t max_gathered_elements() const { return peak_gathered_; }

 private:
  // The group a unit's gradients are reduced over and its shards split
  // across: the data-parallel group for dense units, ep_dp for expert units
  // under expert parallelism.
  struct UnitGroup {
    std::shared_ptr<ProcessGroup> group;  // null: this rank alone
    int rank = 0, size = 1;
    int srank = 0, shards = 1;  // rank and count of shards (1 when unsharded)
    float scale = 1;            // applied to the group's average (expert units: 1 / ep)
  };
  int num_units() const { return static_cast<int>(units_.size()); }
  const UnitGroup& ug(int u) const { return ugroups_[static_cast<size_t>(unit_group_[u])]; }
  // This rank's slice of unit u: flat offset, shard offset, length.
  int64_t slice_begin(int u) const { return units_[u].begin + ug(u).srank * slice_[u]; }
  // A use of unit u is a use of u and of the expert units riding on it.
  const std::vector<int>& used_with(int u) const { return used_with_[static_cast<size_t>(u)]; }
  void on_before(int u, Pass pass);
  void on_after(int u, Pass pass);
  void launch_gather(int u);
  void fetch(int u);
  void release_params(int u);
  void acquire_grads(int u);
  void launch_reduce(int u);
  void drain_one();
  void wait_timed(const WorkPtr& w);
  float* shard_params() const;
  float* shard_grads() const;
  bool half() const { return config_.dtype != DType::kF32; }
  // Bytes of n elements of the parameter and gradient storage type.
  size_t pbytes(int64_t elements) const;
  uint16_t* params16() const { return p16_.as<uint16_t>(); }
  uint16_t* grads16() const { return g16_.as<uint16_t>(); }
  float* masters() const;
  // Gathers unit u's parameters (stage 3) and, in 16-bit mode, widens them
  // into its working copy; binds the unit to what the layers read.
  void bind_for_use(int u);
  void prefetch_after(int u);
  void release_for_use(int u);
  // 16-bit mode, stages 0-1: adds unit u's f32 gradients into the 16-bit ones.
  void flush_grads(int u);
  // Stages 1-2: all-gathers every unit's updated slices into the full parameters.
  void gather_updated_params();
  // Stage 3: drops the resident gathered copies (stale after an update).
  void drop_resident();
  // Sums of squares of this rank's gradients: of split parameters, of whole
  // ones (experts' added over the expert-parallel group when they are not
  // sharded: collective over it then).
  std::pair<double, double> split_sum_squares(int skip = -1);

  ParamStore<float>& store_;
  const Backend<float>& be_;  // the store's: every buffer and operation of the engine
  std::shared_ptr<ProcessGroup> group_;
  std::shared_ptr<ProcessGroup> tp_;  // null: no tensor parallelism
  ZeroConfig config_;
  ExpertGroups experts_;
  int rank_ = 0, world_ = 1;        // in the data-parallel group
  std::vector<UnitGroup> ugroups_;  // [0] dense, [1] expert units
  std::vector<int> unit_group_;     // per unit: its ugroups_ entry
  std::vector<std::vector<int>> used_with_;
  std::vector<Unit> units_;
  std::vector<int64_t> slice_, shard_off_;
  std::vector<std::pair<size_t, size_t>> unit_segments_;  // optimizer segments per unit
  int64_t shard_elements_ = 0;
  std::unique_ptr<NvmeStore> nvme_;
  std::unique_ptr<AdamW> optimizer_;
  Buffer param_shard_, grad_shard_;  // stage 3 / stages 2-3
  // 16-bit mode: parameters (whole layout, or the shard at stage 3),
  // gradients (whole, or the shard from stage 2), the masters (the shard,
  // laid out like the moments; in the nvme file with them when offloaded),
  // and per unit in use its f32 working copy.
  Buffer p16_, g16_, master_;
  // (With weights16, the working copy holds the unit's parameters that
  // are not matrices, and src16_ where its 16-bit parameters are read.)
  std::vector<Buffer> work_;
  std::vector<const uint16_t*> src16_;
  float grad_factor_ = 1;  // 16-bit mode: clipping and 1 / loss scale, applied at the step
  std::unique_ptr<GradBuckets> buckets_;  // stages 0-1 with a group

  // The unit uses of the current micro-batch and the position in them.
  std::vector<UnitUse> plan_;
  size_t pos_ = 0;
  bool reduce_ = false;  // gradients are reduced in this micro-batch
  bool full_ = false;    // stage 3: full parameters gathered into the model

  struct Gathered {
    Buffer buf;
    WorkPtr work;
  };
  std::vector<Gathered> gathered_;  // stage 3, per unit
  std::vector<bool> persistent_;
  size_t gathered_elements_ = 0, peak_gathered_ = 0;

  struct Reducing {
    int unit;
    Buffer buf;  // f32, or 16-bit when `half` (a 16-bit reduce-scatter)
    WorkPtr work;
    bool half = false;
  };
  std::vector<Buffer> grad_bufs_;  // stages 2-3: per unit, while backward writes it
  std::deque<Reducing> reducing_;  // launched reduce-scatters, oldest first
  int64_t reducing_elements_ = 0;

  CommStats stats_;
};

// The sum of squares of a model part split over a tensor-parallel group:
// each rank's {split, whole} sums, the slices added over the group and the
// replicated parameters counted once, from rank 0. Collective over `tp`.
double tensor_parallel_sum(ProcessGroup& tp, double split, double whole);

}  // namespace loom
