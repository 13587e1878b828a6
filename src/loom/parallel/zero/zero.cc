#include "loom/parallel/zero/zero.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "loom/core/error.h"
#include "loom/core/range.h"

namespace loom {

namespace {

size_t f32_bytes(int64_t elements) {
  return static_cast<size_t>(elements) * sizeof(float);
}

// The sum of squares of a model part split over a tensor-parallel group:
// slices add over the group, in rank order; a whole parameter is one tensor
// replicated on every rank of it: its squares count once, taken from rank
// 0, so every rank gets the same sum from the same bits (the replicas
// themselves are checked bitwise equal at checkpoints). Collective over tp.
double tensor_parallel_sum(ProcessGroup& tp, double split, double whole) {
  const double mine[2] = {split, whole};
  const std::vector<double> all = all_gather_words(tp, mine, 2);
  double ss = all[1];
  for (size_t r = 0; r < all.size(); r += 2) ss += all[r];
  return ss;
}

}  // namespace

StoreOptions ZeroEngine::storage(const ZeroConfig& config, int world) {
  StoreOptions s;
  // 16-element slices keep every rank's slice on a 64-byte boundary (32
  // bytes in 16-bit mode's parameters and gradients).
  s.unit_multiple = config.stage >= 1 ? 16 * static_cast<int64_t>(world) : 1;
  // 16-bit mode: the engine holds the parameters and gradients and binds
  // each unit's f32 copies on use.
  const bool half = config.dtype != DType::kF32;
  s.params = config.stage < 3 && !half;
  s.grads = config.stage < 2 && !half;
  return s;
}

namespace {

const ZeroConfig& checked(const ZeroConfig& c) {
  LOOM_CHECK_KIND(kConfig, c.stage >= 0 && c.stage <= 3,
                  "zero_optimization.stage must be 0, 1, 2 or 3, got {}", c.stage);
  LOOM_CHECK_KIND(kConfig, c.reduce_bucket_size > 0,
                  "zero_optimization.reduce_bucket_size must be > 0, got {}", c.reduce_bucket_size);
  LOOM_CHECK(c.dtype == DType::kF32 || c.dtype == DType::kBF16 || c.dtype == DType::kF16,
             "unknown storage type");
  return c;
}

// The store's layout, once the store is known to be built for the engine.
const ParamLayout& built_for(const ParamStore<float>& store, const ZeroConfig& c, int world) {
  const StoreOptions want = ZeroEngine::storage(c, world);
  LOOM_CHECK((store.params() != nullptr) == want.params && (store.grads() != nullptr) == want.grads,
             "the model was not built with ZeroEngine::storage() for stage {}", c.stage);
  return store.layout();
}

}  // namespace

ZeroEngine::ZeroEngine(ParamStore<float>& store, std::shared_ptr<ProcessGroup> group,
                       const ZeroConfig& config, const OptimizerConfig& optimizer,
                       ExpertGroups experts)
    : store_(store),
      be_(store.backend()),
      group_(std::move(group)),
      config_(checked(config)),
      experts_(std::move(experts)),
      rank_(group_ ? group_->rank() : 0),
      world_(group_ ? group_->size() : 1),
      shards_(built_for(store, config_, world_), config_.stage, group_, experts_) {
  optimizer_ = std::make_unique<ShardOptimizer>(shards_, config_, optimizer, be_, rank_);
  const int64_t shard = shards_.shard_elements(), total = store_.layout().total();
  if (half()) {
    p16_ = be_.alloc(pbytes(config_.stage >= 3 ? shard : total), MemCategory::kParams);
    g16_ = be_.alloc(pbytes(config_.stage >= 2 ? shard : total), MemCategory::kGrads);
    work_.resize(static_cast<size_t>(num_units()));
    src16_.assign(static_cast<size_t>(num_units()), nullptr);
    if (config_.weights16 && config_.stage < 3) packs_ = be_.make_weight_packs();
  } else {
    if (config_.stage >= 3) param_shard_ = be_.alloc(f32_bytes(shard), MemCategory::kParams);
    if (config_.stage >= 2) grad_shard_ = be_.alloc(f32_bytes(shard), MemCategory::kGrads);
  }
  reducer_ = make_grad_reducer(store_, shards_, config_,
                               GradTarget{half() ? nullptr : held_grads(), grads16()});
  if (optimizer.one_bit()) {
    LOOM_CHECK_KIND(kConfig, experts_.ep_size() == 1,
                    "optimizer.type {} with parallel.expert {}: expert units reduce over their own "
                    "groups, which 1-bit compression does not cover",
                    optimizer.type, experts_.ep_size());
    onebit_ = std::make_unique<OneBitAdam>(shards_, config_, optimizer, be_);
  }
  if (config_.stage >= 3)
    gatherer_ = std::make_unique<ParamGatherer>(
        store_, shards_, config_,
        half() ? static_cast<const void*>(params16()) : static_cast<const void*>(shard_params()));
  store_.set_hooks(UnitHooks{[this](int u, Pass p) { on_before(u, p); },
                             [this](int u, Pass p) { on_after(u, p); }});
}

ZeroEngine::~ZeroEngine() {
  // The reducer and the gatherer wait for what they have in flight as they go.
  store_.set_hooks(UnitHooks{});
}

size_t ZeroEngine::pbytes(int64_t elements) const {
  return static_cast<size_t>(elements) * dtype_size(config_.dtype);
}

void ZeroEngine::init_params(uint64_t seed) {
  if (packs_) packs_->clear();
  if (half()) {
    // The masters hold this rank's slices; the 16-bit parameters are them
    // rounded (every unit whole below stage 3, drawn unit by unit).
    for (int u = 0; u < num_units(); ++u)
      store_.init_range(seed, shards_.slice_begin(u), shards_.slice_begin(u) + shards_.slice(u),
                        masters() + shards_.shard_offset(u));
    if (config_.stage >= 3) {
      be_.round_16(masters(), params16(), shards_.shard_elements(), config_.dtype);
    } else {
      for (int u = 0; u < num_units(); ++u) {
        Buffer whole = be_.alloc(f32_bytes(unit(u).size()), MemCategory::kWorkspace);
        store_.init_range(seed, unit(u).begin, unit(u).end, whole.as<float>());
        be_.round_16(whole.as<float>(), params16() + unit(u).begin, unit(u).size(), config_.dtype);
      }
    }
    optimizer_->release();
    return;
  }
  if (config_.stage < 3) {
    store_.init(seed);
    return;
  }
  for (int u = 0; u < num_units(); ++u)
    store_.init_range(seed, shards_.slice_begin(u), shards_.slice_begin(u) + shards_.slice(u),
                      shard_params() + shards_.shard_offset(u));
}

void ZeroEngine::zero_grads() {
  grad_factor_ = 1;
  if (half())
    std::memset(grads16(), 0, g16_.bytes());
  else if (config_.stage < 2)
    store_.zero_grads();
  else
    std::memset(shard_grads(), 0, grad_shard_.bytes());
}

void ZeroEngine::begin_micro_batch(std::vector<UnitUse> schedule, bool last) {
  LOOM_CHECK(plan_.empty(), "begin_micro_batch before the previous micro-batch ended");
  LOOM_CHECK(!schedule.empty(), "begin_micro_batch with an empty unit schedule");
  plan_ = std::move(schedule);
  bool backward = false;
  for (const UnitUse& use : plan_) backward = backward || writes_grads(use.pass);
  pos_ = 0;
  // Stages 0-1 keep full gradients and reduce once per step; stages 2-3 hold
  // no full gradients, so every micro-batch's are reduced into the shard.
  // 1-bit Adam's compressed phase keeps every rank's own gradients.
  const bool local = onebit_ && onebit_->compressed(optimizer_steps_ + 1);
  reducer_->begin(backward && (config_.stage >= 2 || last) && !local, last);
  if (gatherer_ && !full_) gatherer_->start(plan_);
}

void ZeroEngine::end_micro_batch() {
  LOOM_CHECK(pos_ == plan_.size(), "a micro-batch ended after {} of its {} unit uses", pos_,
             plan_.size());
  reducer_->end();
  // Nothing but the persistent units stays gathered: a gathered copy kept
  // past the optimizer step would be stale.
  if (gatherer_ && !full_) gatherer_->check_released();
  plan_.clear();
  pos_ = 0;
}

void ZeroEngine::on_before(int u, Pass pass) {
  LOOM_CHECK(pos_ < plan_.size() && plan_[pos_].unit == u && plan_[pos_].pass == pass,
             "unit {} used out of schedule (use {} of {}); call begin_micro_batch first",
             unit(u).name, pos_, plan_.size());
  if ((gatherer_ || half()) && !full_ && reads_params(pass)) {
    for (int w : shards_.used_with(u)) bind_for_use(w);
    if (gatherer_) gatherer_->prefetch(plan_, pos_, u);
  }
  if (writes_grads(pass))
    for (int w : shards_.used_with(u)) reducer_->acquire(w);
}

void ZeroEngine::on_after(int u, Pass pass) {
  // Whether the next use is of the same unit, and whether it reads the
  // parameters or writes gradients: then they stay.
  const bool next_same = pos_ + 1 < plan_.size() && plan_[pos_ + 1].unit == u;
  const bool params_again = next_same && reads_params(plan_[pos_ + 1].pass);
  const bool grads_again = next_same && writes_grads(plan_[pos_ + 1].pass);
  if (writes_grads(pass)) {
    if (!grads_again)
      for (int w : shards_.used_with(u)) reducer_->written(w);
    // The unit's gradients are final once the schedule does not use it again.
    bool later = false;
    for (size_t j = pos_ + 1; j < plan_.size(); ++j) later = later || plan_[j].unit == u;
    if (!later) reducer_->final(u);
  }
  if ((gatherer_ || half()) && !full_ && reads_params(pass) && !params_again)
    for (int w : shards_.used_with(u)) release_for_use(w);
  ++pos_;
}

void ZeroEngine::bind_for_use(int u) {
  const size_t su = static_cast<size_t>(u);
  // 16-bit mode: a unit used again in a row keeps its f32 copy.
  if (half() && work_[su].data()) {
    if (config_.weights16)
      store_.bind_params16(u, src16_[su], work_[su].as<float>(), config_.dtype, packs_.get());
    else
      store_.bind_params(u, work_[su].as<float>());
    return;
  }
  // The unit's whole parameters in the storage type.
  const void* src = gatherer_ ? gatherer_->wait(u, &stats_) : params16() + unit(u).begin;
  if (!half()) {
    store_.bind_params(u, static_cast<float*>(const_cast<void*>(src)));
    return;
  }
  Buffer& w = work_[su];
  const auto* src16 = static_cast<const uint16_t*>(src);
  if (config_.weights16) {
    // The matrices are read where they are, in 16 bits (at stage 3 the
    // gathered copy stays until the unit is released); the rest widened.
    src16_[su] = src16;
    w = be_.alloc(f32_bytes(std::max<int64_t>(16, unit(u).widened)), MemCategory::kComm, false);
    for (const Param& p : store_.layout().params())
      if (p.unit == u && !p.matrix())
        be_.widen_16(src16 + (p.offset - unit(u).begin), w.as<float>() + p.widened, p.numel,
                     config_.dtype);
    store_.bind_params16(u, src16, w.as<float>(), config_.dtype, packs_.get());
    return;
  }
  w = be_.alloc(f32_bytes(unit(u).size()), MemCategory::kComm, false);  // all written next
  be_.widen_16(src16, w.as<float>(), unit(u).size(), config_.dtype);
  // The gathered 16-bit copy is not needed beside the f32 one.
  if (gatherer_) gatherer_->drop(u);
  store_.bind_params(u, w.as<float>());
}

void ZeroEngine::release_for_use(int u) {
  if (half()) {
    work_[static_cast<size_t>(u)] = Buffer();
    src16_[static_cast<size_t>(u)] = nullptr;
    store_.bind_params(u, nullptr);
  }
  if (gatherer_) gatherer_->release(u);
}

std::pair<double, double> ZeroEngine::split_sum_squares(int skip) {
  // This rank's gradient elements: the whole layout below stage 2, else its
  // slice of every unit; each part of a parameter inside them counted apart.
  double split = 0, whole = 0, experts = 0;
  const bool sharded = config_.stage >= 2;
  for (int u = 0; u < num_units(); ++u) {
    if (u == skip) continue;
    const int64_t lo = sharded ? shards_.slice_begin(u) : unit(u).begin;
    const int64_t hi = sharded ? lo + shards_.slice(u) : unit(u).end;
    const int64_t at = sharded ? shards_.shard_offset(u) : lo;  // element lo's index
    for (const Param& p : store_.layout().params()) {
      const auto [b, e] = intersect({lo, hi}, {p.offset, p.offset + p.numel});
      if (b >= e) continue;
      const int64_t i = at + (b - lo);
      const double ss = half() ? be_.sum_squares_16(grads16() + i, e - b, config_.dtype)
                               : be_.sum_squares(held_grads() + i, e - b);
      if (unit(u).expert() && experts_.ep_size() > 1)
        experts += ss;
      else
        (p.shard.sharded() ? split : whole) += ss;
    }
  }
  if (experts_.ep_size() > 1 && !sharded) {
    // Whole on every rank of ep_dp, different across ep: each ep rank's once.
    const std::vector<double> all = all_gather_words(*experts_.ep, &experts, 1);
    experts = 0;
    for (double x : all) experts += x;
  }
  // From stage 2 the expert shards split over ep_dp, so the data-parallel
  // group's sum holds every expert once, as it does every dense unit.
  // 16-bit mode: the gradients are the stored ones times the pending factor.
  const double f2 = double(grad_factor_) * double(grad_factor_);
  return {split * f2, (whole + experts) * f2};
}

std::pair<double, double> ZeroEngine::grad_sum_squares(int skip) {
  auto [split, whole] = split_sum_squares(skip);
  if (group_ && config_.stage >= 2) {
    // Added in rank order, the same on every rank.
    const double mine[2] = {split, whole};
    const std::vector<double> all = all_gather_words(*group_, mine, 2);
    split = whole = 0;
    for (size_t r = 0; r < all.size(); r += 2) split += all[r], whole += all[r + 1];
  }
  return {split, whole};
}

double global_grad_norm(const std::vector<NormPart>& parts, ProcessGroup* tp, ProcessGroup* pp) {
  double split = 0, whole = 0;
  for (const NormPart& part : parts) {
    const auto [a, b] = part.zero->grad_sum_squares(part.skip);
    split += a;
    whole += b;
  }
  const double ss = tp ? tensor_parallel_sum(*tp, split, whole) : split + whole;
  if (!pp) return std::sqrt(ss);
  double total = 0;
  for (double x : all_gather_words(*pp, &ss, 1)) total += x;
  return std::sqrt(total);
}

void ZeroEngine::scale_grads(float scale) {
  if (half())
    grad_factor_ *= scale;
  else
    be_.scale(held_grads(), config_.stage >= 2 ? shards_.shard_elements() : store_.num_params(),
              scale);
}

void ZeroEngine::clip_grads(double norm, double max_norm) {
  if (max_norm > 0 && norm > max_norm) scale_grads(static_cast<float>(max_norm / (norm + 1e-6)));
}

void ZeroEngine::sum_unit_grads(int u, int64_t n, ProcessGroup& group) {
  // The part of [0, n) of the unit this rank holds: all of it below stage
  // 2, else its slice.
  int64_t lo = 0, hi = n;
  int64_t at = unit(u).begin;  // element lo's index in the gradients
  if (config_.stage >= 2) {
    lo = shards_.group(u).srank * shards_.slice(u);
    hi = std::min(n, lo + shards_.slice(u));
    at = shards_.shard_offset(u);
  }
  if (hi <= lo) return;
  void* g = half() ? static_cast<void*>(grads16() + at) : static_cast<void*>(held_grads() + at);
  wait_all({group.all_reduce(g, g, static_cast<size_t>(hi - lo), config_.dtype, ReduceOp::kSum)},
           &stats_);
}

void ZeroEngine::sum_grads(int64_t begin, int64_t end, ProcessGroup& group) {
  std::vector<WorkPtr> works;
  for (const StateRange& r : held(State::kGrads)) {
    const auto [lo, hi] = intersect({begin, end}, {r.begin, r.end});
    if (lo >= hi) continue;
    void* g = half() ? static_cast<void*>(r.data16 + (lo - r.begin))
                     : static_cast<void*>(r.data + (lo - r.begin));
    works.push_back(
        group.all_reduce(g, g, static_cast<size_t>(hi - lo), config_.dtype, ReduceOp::kSum));
  }
  wait_all(works, &stats_);
}

void ZeroEngine::step(double lr, int64_t step, bool sync) {
  // The update goes to the shard; gathered full parameters would go stale.
  LOOM_CHECK(!full_, "optimizer step while the full parameters are gathered");
  optimizer_steps_ = step;
  if (packs_) packs_->clear();
  if (onebit_ && onebit_->updates(step)) {
    // The moments and masters: the whole layout's at stage 0, this rank's
    // slices at stage 1 (whose updated parameters are then gathered).
    if (half())
      onebit_->step_16(masters(), params16(), grads16(), config_.dtype, grad_factor_,
                       optimizer_->exp_avg(), optimizer_->exp_avg_sq(), lr, step, sync);
    else
      onebit_->step(store_.params(), held_grads(), optimizer_->exp_avg(), optimizer_->exp_avg_sq(),
                    lr, step, sync);
    gather_updated_params();
    return;
  }
  // 16-bit mode updates the masters and rounds them into the parameters.
  if (half())
    optimizer_->step_16(params16(), grads16(), grad_factor_, lr, step);
  else
    optimizer_->step(config_.stage >= 3 ? shard_params() : store_.params(), held_grads(), lr, step);
  gather_updated_params();
  // Resident units hold the old values; gather them again on next use.
  if (gatherer_) gatherer_->drop_resident();
}

void ZeroEngine::settle() {
  if (!onebit_) return;
  if (packs_) packs_->clear();
  if (half())
    onebit_->settle_16(masters(), params16(), config_.dtype, optimizer_->exp_avg(),
                       optimizer_->exp_avg_sq(), optimizer_steps_);
  else
    onebit_->settle(store_.params(), optimizer_->exp_avg(), optimizer_->exp_avg_sq(),
                    optimizer_steps_);
}

void ZeroEngine::gather_updated_params() {
  if ((config_.stage != 1 && config_.stage != 2) || !group_) return;
  // Every rank updated its slices; gather the units' full parameters.
  std::vector<WorkPtr> works;
  for (int u = 0; u < num_units(); ++u) {
    const UnitGroup& g = shards_.group(u);
    if (!g.group) continue;
    char* at = half() ? reinterpret_cast<char*>(params16() + unit(u).begin)
                      : reinterpret_cast<char*>(store_.params() + unit(u).begin);
    works.push_back(g.group->all_gather(at + pbytes(g.srank * shards_.slice(u)), at,
                                        static_cast<size_t>(shards_.slice(u)), config_.dtype));
  }
  wait_all(works, &stats_);
}

CompressionStats ZeroEngine::take_compression() {
  CompressionStats s = reducer_->take_compression();
  if (!onebit_) return s;
  // 1-bit Adam: its own compression in the compressed phase, the plain
  // reduction's figures in the warm-up.
  const CompressionStats o = onebit_->take_stats();
  s.sent_bytes += o.sent_bytes;
  s.plain_bytes += o.plain_bytes;
  s.compressed = onebit_->compressed(optimizer_steps_);
  s.local = s.compressed && onebit_->last_local();
  s.error_sum_squares = 0;
  for (const CompressionState& c : onebit_->state()) {
    const int64_t n = c.kind == CompressionState::kError ? c.rows * c.cols : c.end - c.begin;
    s.error_sum_squares += be_.sum_squares(c.data, n);
  }
  return s;
}

std::vector<CompressionState> ZeroEngine::compression_state() {
  std::vector<CompressionState> s = reducer_->state();
  if (onebit_)
    for (const CompressionState& c : onebit_->state()) s.push_back(c);
  return s;
}

void ZeroEngine::resume_steps(int64_t steps, int64_t optimizer_steps) {
  reducer_->set_steps(steps);
  optimizer_steps_ = optimizer_steps;
}

CommStats ZeroEngine::take_stats() {
  CommStats s = stats_;
  const CommStats r = reducer_->take_stats();
  s.comm_s += r.comm_s;
  s.exposed_s += r.exposed_s;
  if (onebit_) {
    const double o = onebit_->take_comm_seconds();
    s.comm_s += o;
    s.exposed_s += o;
  }
  stats_ = CommStats{};
  return s;
}

}  // namespace loom
