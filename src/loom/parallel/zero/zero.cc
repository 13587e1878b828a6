#include "loom/parallel/zero/zero.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>

#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/fault.h"
#include "loom/core/range.h"

namespace loom {

namespace {

size_t bytes_of(int64_t elements) {
  return static_cast<size_t>(elements) * sizeof(float);
}

// Waits for every operation even when one fails, so that none is still
// writing into buffers the caller frees while the error unwinds; then
// rethrows the first failure.
void wait_all(const std::vector<WorkPtr>& works, double* exposed = nullptr,
              double* comm = nullptr) {
  const auto t0 = std::chrono::steady_clock::now();
  std::exception_ptr first;
  for (const WorkPtr& w : works) {
    try {
      w->wait();
      if (comm) *comm += w->seconds();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (exposed) *exposed += seconds_since(t0);
  if (first) std::rethrow_exception(first);
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

ZeroEngine::ZeroEngine(ParamStore<float>& store, std::shared_ptr<ProcessGroup> group,
                       const ZeroConfig& config, const OptimizerConfig& optimizer,
                       ExpertGroups experts)
    : store_(store),
      be_(store.backend()),
      group_(std::move(group)),
      config_(config),
      experts_(std::move(experts)) {
  LOOM_CHECK_KIND(kConfig, config_.stage >= 0 && config_.stage <= 3,
                  "zero_optimization.stage must be 0, 1, 2 or 3, got {}", config_.stage);
  LOOM_CHECK_KIND(kConfig, config_.reduce_bucket_size > 0,
                  "zero_optimization.reduce_bucket_size must be > 0, got {}",
                  config_.reduce_bucket_size);
  LOOM_CHECK(
      config_.dtype == DType::kF32 || config_.dtype == DType::kBF16 || config_.dtype == DType::kF16,
      "unknown storage type");
  if (group_) rank_ = group_->rank(), world_ = group_->size();
  auto unit_group = [&](std::shared_ptr<ProcessGroup> g, float scale) {
    UnitGroup x;
    x.group = std::move(g);
    if (x.group) x.rank = x.group->rank(), x.size = x.group->size();
    if (config_.stage >= 1) x.srank = x.rank, x.shards = x.size;
    x.scale = scale;
    return x;
  };
  ugroups_.push_back(unit_group(group_, 1.0f));
  const int ep = experts_.ep_size();
  LOOM_CHECK(world_ % ep == 0, "an expert-parallel group of {} in a data-parallel group of {}", ep,
             world_);
  ugroups_.push_back(ep > 1 ? unit_group(experts_.ep_dp, 1.0f / static_cast<float>(ep))
                            : ugroups_[0]);
  const StoreOptions want = storage(config_, world_);
  LOOM_CHECK(
      (store_.params() != nullptr) == want.params && (store_.grads() != nullptr) == want.grads,
      "the model was not built with ZeroEngine::storage() for stage {}", config_.stage);

  const ParamLayout& layout = store_.layout();
  units_ = layout.units();
  used_with_.resize(units_.size());
  for (int u = 0; u < num_units(); ++u) {
    unit_group_.push_back(units_[u].expert() ? 1 : 0);
    used_with_[static_cast<size_t>(u)].push_back(u);
    if (units_[u].expert()) used_with_[static_cast<size_t>(units_[u].host)].push_back(u);
  }
  std::vector<AdamWSegment> segments;
  for (int u = 0; u < num_units(); ++u) {
    LOOM_CHECK(units_[u].size() % ug(u).shards == 0,
               "unit {} of {} elements does not split into {}", units_[u].name, units_[u].size(),
               ug(u).shards);
    slice_.push_back(units_[u].size() / ug(u).shards);
    shard_off_.push_back(shard_elements_);
    // The optimizer's segments for this rank's slice: moments at shard
    // offsets; gradients too from stage 2, parameters too at stage 3.
    const int64_t b = slice_begin(u);
    const size_t first = segments.size();
    for (AdamWSegment s : adamw_segments(layout, b, b + slice_[u])) {
      const int64_t in_shard = shard_elements_ + (s.param_offset - b);
      s.state_offset = in_shard;
      if (config_.stage >= 2) s.grad_offset = in_shard;
      if (config_.stage >= 3) s.param_offset = in_shard;
      segments.push_back(s);
    }
    unit_segments_.push_back({first, segments.size()});
    shard_elements_ += slice_[u];
  }

  if (config_.offload_device == "nvme") {
    check_writable_dir(config_.nvme_path, "zero_optimization.offload_optimizer.nvme_path");
    // The moments, and in 16-bit mode the masters after them.
    nvme_ = std::make_unique<NvmeStore>(config_.nvme_path,
                                        (half() ? 3 : 2) * bytes_of(shard_elements_), rank_);
    optimizer_ = std::make_unique<AdamW>(std::move(segments), shard_elements_, optimizer,
                                         nvme_->data(), nvme_->data() + shard_elements_, be_);
  } else {
    optimizer_ = std::make_unique<AdamW>(std::move(segments), shard_elements_, optimizer, nullptr,
                                         nullptr, be_);
    if (half()) master_ = be_.alloc(bytes_of(shard_elements_), MemCategory::kOptimizer);
  }
  if (half()) {
    const int64_t total = layout.total();
    p16_ = be_.alloc(pbytes(config_.stage >= 3 ? shard_elements_ : total), MemCategory::kParams);
    g16_ = be_.alloc(pbytes(config_.stage >= 2 ? shard_elements_ : total), MemCategory::kGrads);
    work_.resize(units_.size());
    src16_.assign(units_.size(), nullptr);
  } else {
    if (config_.stage >= 3)
      param_shard_ = be_.alloc(bytes_of(shard_elements_), MemCategory::kParams);
    if (config_.stage >= 2) grad_shard_ = be_.alloc(bytes_of(shard_elements_), MemCategory::kGrads);
  }
  if (config_.stage <= 1 && group_) {
    std::vector<BucketGroup> groups;
    for (int u = 0; u < num_units(); ++u) groups.push_back({ug(u).group, ug(u).scale});
    buckets_ = std::make_unique<GradBuckets>(layout, std::move(groups), config_.reduce_bucket_size,
                                             config_.overlap_comm, be_);
  }

  gathered_.resize(units_.size());
  grad_bufs_.resize(units_.size());
  for (const Unit& u : units_)
    persistent_.push_back(config_.stage >= 3 && u.size() <= config_.persistence_threshold);
  store_.set_hooks(UnitHooks{[this](int u, Pass p) { on_before(u, p); },
                             [this](int u, Pass p) { on_after(u, p); }});
}

ZeroEngine::~ZeroEngine() {
  store_.set_hooks(UnitHooks{});
  // Nothing may still write into buffers about to be freed. An error that
  // unwinds past a gather or reduce in flight ends a parallel job here
  // (fail_fast) instead of waiting on peers that may be waiting on this rank.
  auto quiet_wait = [](const WorkPtr& w) {
    if (w && !w->test() && std::uncaught_exceptions() > 0)
      fail_fast(format("{} (a ZeRO gather or reduce was still in flight)", last_error()));
    try {
      if (w) w->wait();
    } catch (...) {  // the failure was reported where it happened
    }
  };
  for (auto& g : gathered_) quiet_wait(g.work);
  for (auto& r : reducing_) quiet_wait(r.work);
}

float* ZeroEngine::shard_params() const {
  return param_shard_.as<float>();
}
float* ZeroEngine::shard_grads() const {
  return grad_shard_.as<float>();
}
float* ZeroEngine::masters() const {
  return nvme_ ? nvme_->data() + 2 * shard_elements_ : master_.as<float>();
}
size_t ZeroEngine::pbytes(int64_t elements) const {
  return static_cast<size_t>(elements) * dtype_size(config_.dtype);
}

void ZeroEngine::wait_timed(const WorkPtr& w) {
  wait_all({w}, &stats_.exposed_s, &stats_.comm_s);
}

void ZeroEngine::init_params(uint64_t seed) {
  if (half()) {
    // The masters hold this rank's slices; the 16-bit parameters are them
    // rounded (every unit whole below stage 3, drawn unit by unit).
    for (int u = 0; u < num_units(); ++u)
      store_.init_range(seed, slice_begin(u), slice_begin(u) + slice_[u],
                        masters() + shard_off_[u]);
    if (config_.stage >= 3) {
      be_.round_16(masters(), params16(), shard_elements_, config_.dtype);
    } else {
      for (int u = 0; u < num_units(); ++u) {
        Buffer whole(bytes_of(units_[u].size()), MemCategory::kWorkspace);
        store_.init_range(seed, units_[u].begin, units_[u].end, whole.as<float>());
        be_.round_16(whole.as<float>(), params16() + units_[u].begin, units_[u].size(),
                     config_.dtype);
      }
    }
    if (nvme_) nvme_->release(0, nvme_->bytes());
    return;
  }
  if (config_.stage < 3) {
    store_.init(seed);
    return;
  }
  for (int u = 0; u < num_units(); ++u)
    store_.init_range(seed, slice_begin(u), slice_begin(u) + slice_[u],
                      shard_params() + shard_off_[u]);
}

void ZeroEngine::zero_grads() {
  grad_factor_ = 1;
  if (half())
    std::memset(grads16(), 0, g16_.bytes());
  else if (config_.stage < 2)
    store_.zero_grads();
  else
    std::memset(shard_grads(), 0, bytes_of(shard_elements_));
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
  reduce_ = backward && (config_.stage >= 2 || last);
  if (buckets_ && reduce_) {
    if (half())
      buckets_->begin(grads16(), config_.dtype);
    else
      buckets_->begin(store_.grads(), DType::kF32);
  }
  // Start gathering the first unit whose parameters the micro-batch reads
  // (a pipeline's weight-gradient pass reads none).
  if (config_.stage >= 3 && !full_ && config_.prefetch_bucket_size > 0)
    for (const UnitUse& use : plan_)
      if (reads_params(use.pass)) {
        for (int w : used_with(use.unit)) launch_gather(w);
        break;
      }
}

void ZeroEngine::end_micro_batch() {
  LOOM_CHECK(pos_ == plan_.size(), "a micro-batch ended after {} of its {} unit uses", pos_,
             plan_.size());
  while (!reducing_.empty()) drain_one();
  if (buckets_ && reduce_) {
    BucketStats s = buckets_->finish();
    stats_.comm_s += s.comm_s;
    stats_.exposed_s += s.exposed_s;
  }
  // Nothing but the persistent units stays gathered: a gathered copy kept
  // past the optimizer step would be stale.
  if (config_.stage >= 3 && !full_)
    for (int u = 0; u < num_units(); ++u)
      LOOM_CHECK(persistent_[u] || !gathered_[u].buf.data(),
                 "unit {} still gathered after its micro-batch", units_[u].name);
  plan_.clear();
  pos_ = 0;
}

void ZeroEngine::on_before(int u, Pass pass) {
  LOOM_CHECK(pos_ < plan_.size() && plan_[pos_].unit == u && plan_[pos_].pass == pass,
             "unit {} used out of schedule (use {} of {}); call begin_micro_batch first",
             units_[u].name, pos_, plan_.size());
  if ((config_.stage >= 3 || half()) && !full_ && reads_params(pass)) fetch(u);
  if (writes_grads(pass) && (config_.stage >= 2 || half()))
    for (int w : used_with(u))
      if (!grad_bufs_[w].data()) acquire_grads(w);
}

void ZeroEngine::on_after(int u, Pass pass) {
  // Whether the next use is of the same unit, and whether it reads the
  // parameters or writes gradients: then they stay.
  const bool next_same = pos_ + 1 < plan_.size() && plan_[pos_ + 1].unit == u;
  const bool params_again = next_same && reads_params(plan_[pos_ + 1].pass);
  const bool grads_again = next_same && writes_grads(plan_[pos_ + 1].pass);
  if (writes_grads(pass)) {
    if (config_.stage >= 2) {
      if (!grads_again)
        for (int w : used_with(u)) launch_reduce(w);
    } else {
      if (half() && !grads_again)
        for (int w : used_with(u)) flush_grads(w);
    }
    if (config_.stage < 2 && buckets_ && reduce_) {
      // The unit's gradients are final once the schedule does not use it again.
      bool later = false;
      for (size_t j = pos_ + 1; j < plan_.size(); ++j) later = later || plan_[j].unit == u;
      if (!later) buckets_->ready_from(units_[u].begin);
    }
  }
  if ((config_.stage >= 3 || half()) && !full_ && reads_params(pass) && !params_again)
    for (int w : used_with(u)) release_for_use(w);
  ++pos_;
}

void ZeroEngine::launch_gather(int u) {
  Gathered& g = gathered_[u];
  if (g.buf.data()) return;
  // 16-bit mode gathers the 16-bit slices.
  g.buf = be_.alloc(pbytes(units_[u].size()), MemCategory::kComm);
  const void* mine = half() ? static_cast<const void*>(params16() + shard_off_[u])
                            : static_cast<const void*>(shard_params() + shard_off_[u]);
  if (const UnitGroup& ugr = ug(u); ugr.group) {
    g.work =
        ugr.group->all_gather(mine, g.buf.data(), static_cast<size_t>(slice_[u]), config_.dtype);
    fault_point("zero_gather");
  } else {
    std::memcpy(g.buf.data(), mine, pbytes(slice_[u]));
  }
  gathered_elements_ += static_cast<size_t>(units_[u].size());
  peak_gathered_ = std::max(peak_gathered_, gathered_elements_);
}

void ZeroEngine::fetch(int u) {
  for (int w : used_with(u)) bind_for_use(w);
  if (config_.stage >= 3) prefetch_after(u);
}

void ZeroEngine::bind_for_use(int u) {
  const size_t su = static_cast<size_t>(u);
  // 16-bit mode: a unit used again in a row keeps its f32 copy.
  if (half() && work_[su].data()) {
    if (config_.weights16)
      store_.bind_params16(u, src16_[su], work_[su].as<float>(), config_.dtype);
    else
      store_.bind_params(u, work_[su].as<float>());
    return;
  }
  const void* src = nullptr;  // the unit's whole parameters in the storage type
  if (config_.stage >= 3) {
    launch_gather(u);
    Gathered& g = gathered_[u];
    if (g.work) {
      wait_timed(g.work);
      g.work = nullptr;
    }
    src = g.buf.data();
  } else {
    src = params16() + units_[u].begin;
  }
  if (!half()) {
    store_.bind_params(u, static_cast<float*>(const_cast<void*>(src)));
    return;
  }
  Buffer& w = work_[su];
  if (config_.weights16) {
    // The matrices are read where they are, in 16 bits (at stage 3 the
    // gathered copy stays until the unit is released); the rest widened.
    const auto* src16 = static_cast<const uint16_t*>(src);
    src16_[su] = src16;
    w = be_.alloc(bytes_of(std::max<int64_t>(16, units_[u].widened)), MemCategory::kComm, false);
    for (const Param& p : store_.layout().params())
      if (p.unit == u && !p.matrix())
        be_.widen_16(src16 + (p.offset - units_[u].begin), w.as<float>() + p.widened, p.numel,
                     config_.dtype);
    store_.bind_params16(u, src16, w.as<float>(), config_.dtype);
    return;
  }
  w = be_.alloc(bytes_of(units_[u].size()), MemCategory::kComm, false);  // all written next
  be_.widen_16(static_cast<const uint16_t*>(src), w.as<float>(), units_[u].size(), config_.dtype);
  // The gathered 16-bit copy is not needed beside the f32 one.
  if (config_.stage >= 3 && !persistent_[u]) {
    gathered_elements_ -= static_cast<size_t>(units_[u].size());
    gathered_[u] = Gathered{};
  }
  store_.bind_params(u, w.as<float>());
}

void ZeroEngine::release_for_use(int u) {
  if (half()) {
    work_[static_cast<size_t>(u)] = Buffer();
    src16_[static_cast<size_t>(u)] = nullptr;
    store_.bind_params(u, nullptr);
  }
  if (config_.stage >= 3) release_params(u);
}

void ZeroEngine::prefetch_after(int u) {
  if (config_.prefetch_bucket_size <= 0) return;
  // Prefetch along the schedule: at least the next unit, then more while
  // the elements in flight stay within stage3_prefetch_bucket_size.
  // Units gathered ahead count whether or not their gather has finished.
  int64_t ahead = 0;
  std::vector<bool> seen(units_.size(), false);
  seen[static_cast<size_t>(u)] = true;
  for (size_t j = pos_ + 1; j < plan_.size(); ++j) {
    if (!reads_params(plan_[j].pass)) continue;
    if (seen[static_cast<size_t>(plan_[j].unit)]) continue;
    seen[static_cast<size_t>(plan_[j].unit)] = true;
    // A unit and the expert units riding on it count as one.
    int64_t missing = 0;
    for (int v : used_with(plan_[j].unit)) {
      if (!gathered_[v].buf.data())
        missing += units_[v].size();
      else if (!persistent_[v])
        ahead += units_[v].size();
    }
    if (missing == 0) continue;
    if (ahead > 0 && ahead + missing > config_.prefetch_bucket_size) break;
    for (int v : used_with(plan_[j].unit))
      if (!gathered_[v].buf.data()) launch_gather(v);
    ahead += missing;
  }
}

void ZeroEngine::release_params(int u) {
  if (persistent_[u]) return;
  Gathered& g = gathered_[u];
  if (!g.buf.data()) return;
  LOOM_CHECK(g.work == nullptr, "unit {} released while its gather is in flight", units_[u].name);
  store_.bind_params(u, nullptr);
  gathered_elements_ -= static_cast<size_t>(units_[u].size());
  g.buf = Buffer();
}

void ZeroEngine::acquire_grads(int u) {
  // Finished reductions free their buffers first; then wait for the oldest
  // while more than reduce_bucket_size elements are being reduced. The newest
  // reduction always stays in flight, so it overlaps this unit's backward.
  while (!reducing_.empty() && (!reducing_.front().work || reducing_.front().work->test()))
    drain_one();
  while (reducing_.size() > 1 && reducing_elements_ > config_.reduce_bucket_size) drain_one();
  grad_bufs_[u] = be_.alloc(bytes_of(units_[u].size()), MemCategory::kComm);
  store_.bind_grads(u, grad_bufs_[u].as<float>());
}

void ZeroEngine::launch_reduce(int u) {
  Buffer buf = std::move(grad_bufs_[u]);
  store_.bind_grads(u, nullptr);
  WorkPtr w;
  bool half16 = false;
  if (const UnitGroup& g = ug(u); g.group) {
    if (half()) {
      // Rounded to 16 bits and reduced in 16 bits (accumulated in f32).
      Buffer h(pbytes(units_[u].size()), MemCategory::kComm, false);  // all written next
      be_.round_16(buf.as<float>(), h.as<uint16_t>(), units_[u].size(), config_.dtype);
      buf = std::move(h);
      half16 = true;
    }
    // Rank r's averaged slice lands in place, at block r of the buffer.
    char* p = buf.as<char>();
    w = g.group->reduce_scatter(p, p + pbytes(g.srank * slice_[u]), static_cast<size_t>(slice_[u]),
                                config_.dtype, ReduceOp::kAvg);
  }
  reducing_.push_back({u, std::move(buf), std::move(w), half16});
  if (reducing_.back().work) fault_point("zero_reduce");
  reducing_elements_ += units_[u].size();
  if (!config_.overlap_comm)
    while (!reducing_.empty()) drain_one();
}

void ZeroEngine::drain_one() {
  Reducing& r = reducing_.front();
  if (r.work) wait_timed(r.work);
  const int u = r.unit;
  if (half()) {
    // Added into the 16-bit gradients in f32, rounded once.
    uint16_t* dst = grads16() + shard_off_[u];
    const int64_t at = ug(u).srank * slice_[u];
    if (r.half)
      be_.accumulate_16(nullptr, r.buf.as<uint16_t>() + at, ug(u).scale, dst, slice_[u],
                        config_.dtype);
    else
      be_.accumulate_16(r.buf.as<float>() + at, nullptr, ug(u).scale, dst, slice_[u],
                        config_.dtype);
    reducing_elements_ -= units_[u].size();
    reducing_.pop_front();
    return;
  }
  const float* src = r.buf.as<float>() + ug(u).srank * slice_[u];
  float* dst = shard_grads() + shard_off_[u];
  // Accumulates over micro-batches (each already scaled by 1 / accumulation).
  if (const float scale = ug(u).scale; scale != 1.0f)
    for (int64_t i = 0; i < slice_[u]; ++i) dst[i] += src[i] * scale;
  else
    for (int64_t i = 0; i < slice_[u]; ++i) dst[i] += src[i];
  reducing_elements_ -= units_[u].size();
  reducing_.pop_front();
}

void ZeroEngine::flush_grads(int u) {
  Buffer buf = std::move(grad_bufs_[u]);
  store_.bind_grads(u, nullptr);
  be_.accumulate_16(buf.as<float>(), nullptr, 1.0f, grads16() + units_[u].begin, units_[u].size(),
                    config_.dtype);
}

std::pair<double, double> ZeroEngine::split_sum_squares(int skip) {
  // This rank's gradient elements: the whole layout below stage 2, else its
  // slice of every unit; each part of a parameter inside them counted apart.
  double split = 0, whole = 0, experts = 0;
  const std::vector<Param>& params = store_.layout().params();
  for (int u = 0; u < num_units(); ++u) {
    if (u == skip) continue;
    const int64_t lo = config_.stage >= 2 ? slice_begin(u) : units_[u].begin;
    const int64_t hi = config_.stage >= 2 ? lo + slice_[u] : units_[u].end;
    const int64_t at = config_.stage >= 2 ? shard_off_[u] : lo;  // element lo's index
    for (const Param& p : params) {
      const auto [b, e] = intersect({lo, hi}, {p.offset, p.offset + p.numel});
      if (b >= e) continue;
      const double ss =
          half()
              ? be_.sum_squares_16(grads16() + at + (b - lo), e - b, config_.dtype)
              : be_.sum_squares(
                    (config_.stage >= 2 ? shard_grads() : store_.grads()) + at + (b - lo), e - b);
      if (units_[u].expert() && experts_.ep_size() > 1)
        experts += ss;
      else
        (p.shard.sharded() ? split : whole) += ss;
    }
  }
  if (experts_.ep_size() > 1 && config_.stage < 2) {
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

void ZeroEngine::scale_grads(float scale) {
  if (half())
    grad_factor_ *= scale;
  else if (config_.stage >= 2)
    be_.scale(shard_grads(), shard_elements_, scale);
  else
    be_.scale(store_.grads(), store_.num_params(), scale);
}

void ZeroEngine::sum_unit_grads(int u, int64_t n, ProcessGroup& group) {
  // The part of [0, n) of the unit this rank holds: all of it below stage
  // 2, else its slice.
  int64_t lo = 0, hi = n;
  int64_t at = units_[u].begin;  // element lo's index in the gradients
  if (config_.stage >= 2) {
    lo = ug(u).srank * slice_[u];
    hi = std::min(n, lo + slice_[u]);
    at = shard_off_[u];
  }
  if (hi <= lo) return;
  void* g = half() ? static_cast<void*>(grads16() + at)
                   : static_cast<void*>((config_.stage >= 2 ? shard_grads() : store_.grads()) + at);
  WorkPtr w = group.all_reduce(g, g, static_cast<size_t>(hi - lo), config_.dtype, ReduceOp::kSum);
  wait_timed(w);
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
  wait_all(works, &stats_.exposed_s, &stats_.comm_s);
}

double ZeroEngine::grad_norm() {
  const bool tp = tp_ && tp_->size() > 1;
  const bool ep = experts_.ep_size() > 1;
  if (config_.stage < 2 && !tp && !ep && !half())
    return std::sqrt(be_.sum_squares(store_.grads(), store_.num_params()));
  double ss = 0;
  if (!tp && !ep) {
    if (half())
      ss = be_.sum_squares_16(grads16(), config_.stage >= 2 ? shard_elements_ : store_.num_params(),
                              config_.dtype) *
           double(grad_factor_) * double(grad_factor_);
    else
      ss = be_.sum_squares(shard_grads(), shard_elements_);
    // Below stage 2 every rank holds the same whole gradients.
    if (group_ && config_.stage >= 2) {
      // The ranks' partial sums, added in rank order, the same on every rank:
      // no f32 rounding or overflow.
      const std::vector<double> all = all_gather_words(*group_, &ss, 1);
      ss = 0;
      for (double x : all) ss += x;
    }
  } else {
    const auto [split, whole] = grad_sum_squares();
    ss = tp ? tensor_parallel_sum(*tp_, split, whole) : split + whole;
  }
  return std::sqrt(ss);
}

double tensor_parallel_sum(ProcessGroup& tp, double split, double whole) {
  // Slices add over the group, in rank order; a whole parameter is one
  // tensor replicated on every rank of it: its squares count once, taken
  // from rank 0, so every rank gets the same sum from the same bits (the
  // replicas themselves are checked bitwise equal at checkpoints).
  const double mine[2] = {split, whole};
  const std::vector<double> all = all_gather_words(tp, mine, 2);
  double ss = all[1];
  for (size_t r = 0; r < all.size(); r += 2) ss += all[r];
  return ss;
}

void ZeroEngine::clip_grads(double norm, double max_norm) {
  if (max_norm > 0 && norm > max_norm) scale_grads(static_cast<float>(max_norm / (norm + 1e-6)));
}

void ZeroEngine::step(double lr, int64_t step) {
  // The update goes to the shard; gathered full parameters would go stale.
  LOOM_CHECK(!full_, "optimizer step while the full parameters are gathered");
  float* params = config_.stage >= 3 ? shard_params() : store_.params();
  const float* grads = config_.stage >= 2 ? shard_grads() : store_.grads();
  // Segments [first, last): 16-bit mode updates the masters and rounds them
  // into the 16-bit parameters.
  auto update = [&](size_t first, size_t last) {
    if (half())
      optimizer_->step_16(masters(), params16(), grads16(), config_.dtype, grad_factor_, lr, step,
                          first, last);
    else
      optimizer_->step(params, grads, lr, step, first, last);
  };
  if (nvme_) {
    // Unit by unit: only the moments (and masters) being updated are resident.
    const int parts = half() ? 3 : 2;
    for (int u = 0; u < num_units(); ++u) {
      const size_t bytes = bytes_of(slice_[u]);
      memory_tracker().on_alloc(MemCategory::kOptimizer, parts * bytes);
      update(unit_segments_[u].first, unit_segments_[u].second);
      const size_t off = bytes_of(shard_off_[u]);
      for (int k = 0; k < parts; ++k) nvme_->release(k * bytes_of(shard_elements_) + off, bytes);
      memory_tracker().on_free(MemCategory::kOptimizer, parts * bytes);
    }
    // Faults map a few neighbouring pages in too (fault-around); drop those.
    nvme_->release(0, nvme_->bytes());
  } else {
    update(0, SIZE_MAX);
  }
  gather_updated_params();
  drop_resident();
}

void ZeroEngine::gather_updated_params() {
  if ((config_.stage != 1 && config_.stage != 2) || !group_) return;
  // Every rank updated its slices; gather the units' full parameters.
  std::vector<WorkPtr> works;
  for (int u = 0; u < num_units(); ++u) {
    const UnitGroup& g = ug(u);
    if (!g.group) continue;
    char* unit = half() ? reinterpret_cast<char*>(params16() + units_[u].begin)
                        : reinterpret_cast<char*>(store_.params() + units_[u].begin);
    works.push_back(g.group->all_gather(unit + pbytes(g.srank * slice_[u]), unit,
                                        static_cast<size_t>(slice_[u]), config_.dtype));
  }
  wait_all(works, &stats_.exposed_s, &stats_.comm_s);
}

void ZeroEngine::drop_resident() {
  if (config_.stage < 3) return;
  // Resident units hold the old values; gather them again on next use.
  for (int u = 0; u < num_units(); ++u)
    if (persistent_[u] && gathered_[u].buf.data()) {
      if (gathered_[u].work) gathered_[u].work->wait();
      store_.bind_params(u, nullptr);
      gathered_elements_ -= static_cast<size_t>(units_[u].size());
      gathered_[u] = Gathered{};
    }
}

void ZeroEngine::sync_params() {
  if (!half()) return;
  if (config_.stage >= 3) {
    be_.round_16(masters(), params16(), shard_elements_, config_.dtype);
  } else {
    for (int u = 0; u < num_units(); ++u)
      be_.round_16(masters() + shard_off_[u], params16() + slice_begin(u), slice_[u],
                   config_.dtype);
    gather_updated_params();
  }
  drop_resident();
  if (nvme_) nvme_->release(0, nvme_->bytes());
}

CommStats ZeroEngine::take_stats() {
  CommStats s = stats_;
  stats_ = CommStats{};
  return s;
}

void ZeroEngine::gather_full_params() {
  if (half()) {
    // The masters, gathered: what a checkpoint holds (and what sampling at
    // the end of a run computes with).
    if (full_) return;
    store_.allocate_params();
    std::vector<WorkPtr> works;
    for (int u = 0; u < num_units(); ++u) {
      const UnitGroup& g = ug(u);
      float* unit = store_.params() + units_[u].begin;
      if (g.group && g.shards > 1)
        works.push_back(g.group->all_gather(masters() + shard_off_[u], unit,
                                            static_cast<size_t>(slice_[u]), DType::kF32));
      else
        std::memcpy(unit, masters() + shard_off_[u], bytes_of(slice_[u]));
    }
    wait_all(works);
    if (nvme_) nvme_->release(0, nvme_->bytes());
    full_ = true;
    return;
  }
  if (config_.stage < 3 || full_) return;
  store_.allocate_params();
  std::vector<WorkPtr> works;
  for (int u = 0; u < num_units(); ++u) {
    const float* mine = shard_params() + shard_off_[u];
    float* unit = store_.params() + units_[u].begin;
    if (ug(u).group)
      works.push_back(
          ug(u).group->all_gather(mine, unit, static_cast<size_t>(slice_[u]), DType::kF32));
    else
      std::memcpy(unit, mine, bytes_of(slice_[u]));
  }
  wait_all(works);
  full_ = true;
}

std::vector<float> ZeroEngine::gather_grads() {
  std::vector<float> out(static_cast<size_t>(store_.num_params()), 0.0f);
  const float f = grad_factor_;  // 16-bit mode: the factor still pending
  // n elements of the reduced gradients from element `at` of what this rank
  // holds, widened and scaled to the values the optimizer will use.
  auto read = [&](int64_t at, int64_t n, float* dst) {
    if (half()) {
      be_.widen_16(grads16() + at, dst, n, config_.dtype);
      for (int64_t i = 0; i < n; ++i) dst[i] *= f;
    } else {
      std::memcpy(dst, (config_.stage >= 2 ? shard_grads() : store_.grads()) + at, bytes_of(n));
    }
  };
  if (config_.stage < 2) {
    read(0, store_.num_params(), out.data());
    return out;
  }
  std::vector<WorkPtr> works;
  std::vector<std::vector<float>> slices(static_cast<size_t>(num_units()));
  for (int u = 0; u < num_units(); ++u) {
    std::vector<float>& mine = slices[static_cast<size_t>(u)];
    mine.resize(static_cast<size_t>(slice_[u]));
    read(shard_off_[u], slice_[u], mine.data());
    float* unit = out.data() + units_[u].begin;
    if (const UnitGroup& g = ug(u); g.group && g.shards > 1)
      works.push_back(
          g.group->all_gather(mine.data(), unit, static_cast<size_t>(slice_[u]), DType::kF32));
    else
      std::memcpy(unit, mine.data(), bytes_of(slice_[u]));
  }
  wait_all(works);
  return out;
}

void ZeroEngine::release_full_params(bool keep_changes) {
  if (half()) {
    if (!full_) return;
    if (keep_changes) {
      for (int u = 0; u < num_units(); ++u)
        std::memcpy(masters() + shard_off_[u], store_.params() + slice_begin(u),
                    bytes_of(slice_[u]));
    }
    store_.release_params();
    full_ = false;
    if (keep_changes) sync_params();
    return;
  }
  if (config_.stage < 3 || !full_) return;
  if (keep_changes)
    for (int u = 0; u < num_units(); ++u)
      std::memcpy(shard_params() + shard_off_[u], store_.params() + slice_begin(u),
                  bytes_of(slice_[u]));
  store_.release_params();
  // Gathered copies (resident units) may be stale now.
  for (int u = 0; u < num_units(); ++u)
    if (gathered_[u].buf.data()) {
      if (gathered_[u].work) gathered_[u].work->wait();
      gathered_elements_ -= static_cast<size_t>(units_[u].size());
      gathered_[u] = Gathered{};
    }
  full_ = false;
}

void ZeroEngine::gather_moments(std::vector<float>& m, std::vector<float>& v) {
  const size_t total = static_cast<size_t>(store_.num_params());
  m.assign(total, 0.0f);
  v.assign(total, 0.0f);
  std::vector<WorkPtr> works;
  for (int u = 0; u < num_units(); ++u) {
    const size_t n = static_cast<size_t>(slice_[u]);
    const float* sm = optimizer_->exp_avg() + shard_off_[u];
    const float* sv = optimizer_->exp_avg_sq() + shard_off_[u];
    if (const UnitGroup& g = ug(u); g.group && g.shards > 1) {
      works.push_back(g.group->all_gather(sm, m.data() + units_[u].begin, n, DType::kF32));
      works.push_back(g.group->all_gather(sv, v.data() + units_[u].begin, n, DType::kF32));
    } else {
      std::memcpy(m.data() + slice_begin(u), sm, bytes_of(slice_[u]));
      std::memcpy(v.data() + slice_begin(u), sv, bytes_of(slice_[u]));
    }
  }
  wait_all(works);
  if (nvme_) nvme_->release(0, nvme_->bytes());
}

void ZeroEngine::load_moments(const float* m, const float* v) {
  for (int u = 0; u < num_units(); ++u) {
    std::memcpy(optimizer_->exp_avg() + shard_off_[u], m + slice_begin(u), bytes_of(slice_[u]));
    std::memcpy(optimizer_->exp_avg_sq() + shard_off_[u], v + slice_begin(u), bytes_of(slice_[u]));
  }
  if (nvme_) nvme_->release(0, nvme_->bytes());
}

std::vector<ZeroEngine::StateRange> ZeroEngine::held(State s) const {
  std::vector<StateRange> out;
  if (s == State::kGrads) {
    // Whole in the model's buffer at stages 0-1, this rank's slices from 2.
    for (int u = 0; u < num_units(); ++u) {
      StateRange r;
      if (config_.stage < 2) {
        r = {units_[u].begin, units_[u].end, nullptr};
        if (half())
          r.data16 = grads16() + units_[u].begin;
        else
          r.data = store_.grads() + units_[u].begin;
      } else {
        r = {slice_begin(u), slice_begin(u) + slice_[u], nullptr};
        if (half())
          r.data16 = grads16() + shard_off_[u];
        else
          r.data = shard_grads() + shard_off_[u];
      }
      out.push_back(r);
    }
    return out;
  }
  const std::vector<StateRange> mine = share(s);
  for (int u = 0; u < num_units(); ++u) {
    // 16-bit mode: the parameters are the masters, held like the moments.
    const bool whole = s == State::kParams && !half() ? config_.stage < 3 : ug(u).shards == 1;
    if (!whole) {
      out.push_back(mine[static_cast<size_t>(u)]);
      continue;
    }
    float* base = s == State::kParams
                      ? (half() ? masters() + shard_off_[u] : store_.params() + units_[u].begin)
                  : s == State::kExpAvg ? optimizer_->exp_avg() + shard_off_[u]
                                        : optimizer_->exp_avg_sq() + shard_off_[u];
    out.push_back({units_[u].begin, units_[u].end, base});
  }
  return out;
}

std::vector<ZeroEngine::StateRange> ZeroEngine::share(State s) const {
  LOOM_CHECK(s != State::kGrads, "gradients are not part of a checkpoint");
  std::vector<StateRange> out;
  for (int u = 0; u < num_units(); ++u) {
    int64_t b = slice_begin(u), e = b + slice_[u];
    if (const UnitGroup& g = ug(u); g.shards == 1) {  // not sharded: an equal part for each rank
      b = units_[u].begin + units_[u].size() * g.rank / g.size;
      e = units_[u].begin + units_[u].size() * (g.rank + 1) / g.size;
    }
    // Where element b is: the model's buffer or this rank's shard.
    float* base = nullptr;
    if (s == State::kParams && half())
      base = masters() + shard_off_[u] + (b - slice_begin(u));
    else if (s == State::kParams)
      base = config_.stage < 3 ? store_.params() + b
                               : shard_params() + shard_off_[u] + (b - slice_begin(u));
    else
      base = (s == State::kExpAvg ? optimizer_->exp_avg() : optimizer_->exp_avg_sq()) +
             shard_off_[u] + (b - slice_begin(u));
    out.push_back({b, e, base});
  }
  return out;
}

void ZeroEngine::release_offloaded() {
  if (nvme_) nvme_->release(0, nvme_->bytes());
}

size_t ZeroEngine::optimizer_resident_bytes() const {
  return nvme_ ? nvme_->resident_bytes() : (half() ? 3 : 2) * bytes_of(shard_elements_);
}

}  // namespace loom
