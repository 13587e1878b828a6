#include "loom/parallel/zero/grad_reducer.h"

#include "loom/parallel/zero/bucketed_reducer.h"

#include <vector>

#include "loom/core/error.h"
#include "loom/core/fault.h"

namespace loom {

namespace {

size_t f32_bytes(int64_t elements) {
  return static_cast<size_t>(elements) * sizeof(float);
}

DType wire_type(const ZeroConfig& c) {
  if (c.compression.type == "fp16") return DType::kF16;
  if (c.compression.type == "bf16") return DType::kBF16;
  return c.dtype;
}

}  // namespace

ReducerBase::ReducerBase(ParamStore<float>& store, const ShardLayout& shards,
                         const ZeroConfig& config, GradTarget target)
    : store_(store),
      be_(store.backend()),
      shards_(shards),
      config_(config),
      target_(target),
      wire_(wire_type(config)),
      bufs_(static_cast<size_t>(shards.num_units())) {
  LOOM_CHECK(wire_ == config.dtype || config.dtype == DType::kF32,
             "comm.compression {} needs f32 gradients", config.compression.type);
}

void ReducerBase::bind(int u) {
  buf(u) = be_.alloc(f32_bytes(shards_.unit(u).size()), MemCategory::kComm);
  store_.bind_grads(u, buf(u).as<float>());
}

Buffer ReducerBase::unbind(int u) {
  store_.bind_grads(u, nullptr);
  return std::move(buf(u));
}

BucketedAllReduce::BucketedAllReduce(ParamStore<float>& store, const ShardLayout& shards,
                                     const ZeroConfig& config, GradTarget target)
    : ReducerBase(store, shards, config, target) {
  if (!shards.dense().group) return;  // one process: nothing to reduce
  // Units reduced alike share an entry: one for the dense units, one for
  // the expert units.
  std::vector<int> of_unit;
  for (int u = 0; u < shards.num_units(); ++u) {
    const UnitGroup& g = shards.group(u);
    int k = 0;
    while (k < static_cast<int>(groups_.size()) &&
           (groups_[static_cast<size_t>(k)]->group != g.group ||
            groups_[static_cast<size_t>(k)]->scale != g.scale))
      ++k;
    if (k == static_cast<int>(groups_.size())) groups_.push_back(&g);
    of_unit.push_back(k);
  }
  // Walk parameters from the last to the first; cut a bucket once it
  // holds at least reduce_bucket_size elements, or where the group
  // changes. Parameters are contiguous in the flat buffer, so each bucket
  // is one range (alignment padding included, zero on every rank).
  const auto& ps = shards.layout().params();
  int64_t end = shards.layout().total();
  for (size_t i = ps.size(); i-- > 0;) {
    const int64_t begin = ps[i].offset;
    const int g = of_unit[static_cast<size_t>(ps[i].unit)];
    if (end - begin >= config.reduce_bucket_size || i == 0 ||
        of_unit[static_cast<size_t>(ps[i - 1].unit)] != g) {
      buckets_.push_back({begin, end, g, nullptr, Buffer()});
      end = begin;
    }
  }
}

BucketedAllReduce::~BucketedAllReduce() {
  for (const Bucket& b : buckets_) wait_quietly(b.work, "a gradient all-reduce");
}

void BucketedAllReduce::begin(bool reduce, bool) {
  reduce_ = reduce && !buckets_.empty();
  next_ = 0;
  for (Bucket& b : buckets_) b.work = nullptr;
}

void BucketedAllReduce::acquire(int u) {
  // f32: backward writes into the store's gradients.
  if (half() && !buf(u).data()) bind(u);
}

void BucketedAllReduce::written(int u) {
  if (!half()) return;
  // Added into the 16-bit gradients in f32, rounded once.
  const Buffer b = unbind(u);
  be_.accumulate_16(b.as<float>(), nullptr, 1.0f, target_.h16 + shards_.unit(u).begin,
                    shards_.unit(u).size(), config_.dtype);
}

void BucketedAllReduce::final(int u) {
  if (!reduce_ || !config_.overlap_comm) return;
  // Every gradient from the unit's first element on is final.
  const int64_t from = shards_.unit(u).begin;
  while (next_ < buckets_.size() && buckets_[next_].begin >= from) launch(buckets_[next_++]);
}

void BucketedAllReduce::end() {
  if (!reduce_) return;
  while (next_ < buckets_.size()) launch(buckets_[next_++]);
  complete();
  reduce_ = false;
  ++steps_;
}

void BucketedAllReduce::launch(Bucket& b) {
  const UnitGroup& g = group_of(b);
  if (!g.group) return;
  const int64_t n = b.end - b.begin;
  cstats_.plain_bytes += all_reduce_volume(double(pbytes(n)), g.size);
  cstats_.sent_bytes += all_reduce_volume(double(n) * double(dtype_size(wire())), g.size);
  if (wire() != config_.dtype) {
    // fp16/bf16 compression of f32 gradients: divided by the group's size
    // first (so that fp16 holds the sum), rounded, summed, widened back.
    float* x = target_.f32 + b.begin;
    be_.scale(x, n, 1.0f / static_cast<float>(g.size));
    b.wire = be_.alloc(static_cast<size_t>(n) * dtype_size(wire()), MemCategory::kComm, false);
    be_.round_16(x, b.wire.as<uint16_t>(), n, wire());
    b.work = g.group->all_reduce(b.wire.data(), b.wire.data(), static_cast<size_t>(n), wire(),
                                 ReduceOp::kSum);
    return;
  }
  b.work = g.group->all_reduce(at(b), at(b), static_cast<size_t>(n), config_.dtype, ReduceOp::kAvg);
}

void BucketedAllReduce::scale(const Bucket& b, float s) const {
  if (half())
    be_.scale_16(target_.h16 + b.begin, b.end - b.begin, s, config_.dtype);
  else
    be_.scale(target_.f32 + b.begin, b.end - b.begin, s);
}

void BucketedAllReduce::complete() {
  std::vector<WorkPtr> works;
  for (const Bucket& b : buckets_)
    if (b.work) works.push_back(b.work);
  wait_all(works, &stats_);
  cstats_.compressed = wire() != config_.dtype;
  for (Bucket& b : buckets_) {
    b.work = nullptr;
    if (b.wire.data()) {
      be_.widen_16(b.wire.as<uint16_t>(), target_.f32 + b.begin, b.end - b.begin, wire());
      b.wire = Buffer();
    }
    const float s = group_of(b).scale;
    if (s != 1.0f) scale(b, s);
  }
}

UnitReduceScatter::~UnitReduceScatter() {
  for (const Reducing& r : reducing_) wait_quietly(r.work, "a ZeRO gradient reduce-scatter");
}

void UnitReduceScatter::acquire(int u) {
  if (buf(u).data()) return;
  // Finished reductions free their buffers first; then wait for the
  // oldest while more than reduce_bucket_size elements are being reduced.
  // The newest reduction always stays in flight, so it overlaps this
  // unit's backward.
  while (!reducing_.empty() && (!reducing_.front().work || reducing_.front().work->test()))
    drain_one();
  while (reducing_.size() > 1 && reducing_elements_ > config_.reduce_bucket_size) drain_one();
  bind(u);
}

void UnitReduceScatter::written(int u) {
  Buffer b = unbind(u);
  const int64_t n = shards_.unit(u).size(), slice = shards_.slice(u);
  const size_t wbytes = dtype_size(wire());
  WorkPtr w;
  bool half16 = false;
  if (const UnitGroup& g = shards_.group(u); g.group) {
    ReduceOp op = ReduceOp::kAvg;
    if (wire() != DType::kF32) {
      // Rounded to 16 bits and reduced in 16 bits (accumulated in f32).
      // fp16/bf16 compression of f32 gradients divides by the group's
      // size first, so that fp16 holds the sum.
      if (!half()) {
        be_.scale(b.as<float>(), n, 1.0f / static_cast<float>(g.size));
        op = ReduceOp::kSum;
      }
      Buffer h = be_.alloc(static_cast<size_t>(n) * wbytes, MemCategory::kComm, false);
      be_.round_16(b.as<float>(), h.as<uint16_t>(), n, wire());
      b = std::move(h);
      half16 = true;
    }
    cstats_.plain_bytes += spread_volume(double(pbytes(n)), g.size);
    cstats_.sent_bytes += spread_volume(double(n) * double(wbytes), g.size);
    // Rank r's averaged slice lands in place, at block r of the buffer.
    char* p = b.as<char>();
    w = g.group->reduce_scatter(p, p + static_cast<size_t>(g.srank * slice) * wbytes,
                                static_cast<size_t>(slice), wire(), op);
  }
  reducing_.push_back({u, std::move(b), std::move(w), half16});
  if (reducing_.back().work) fault_point("zero_reduce");
  reducing_elements_ += n;
  if (!config_.overlap_comm)
    while (!reducing_.empty()) drain_one();
}

void UnitReduceScatter::end() {
  while (!reducing_.empty()) drain_one();
  // Every unit backward wrote was reduced (a reducer that missed one would
  // drop its gradients).
  for (int u = 0; u < shards_.num_units(); ++u)
    LOOM_CHECK(!buf(u).data(), "unit {}'s gradients were written but not reduced",
               shards_.unit(u).name);
  cstats_.compressed = wire() != config_.dtype;
}

void UnitReduceScatter::drain_one() {
  Reducing& r = reducing_.front();
  if (r.work) wait_for_use(r.work, be_, &stats_);
  const int u = r.unit;
  const UnitGroup& g = shards_.group(u);
  const int64_t at = g.srank * shards_.slice(u), n = shards_.slice(u);
  if (half()) {
    // Added into the 16-bit gradients in f32, rounded once.
    uint16_t* dst = target_.h16 + shards_.shard_offset(u);
    if (r.half)
      be_.accumulate_16(nullptr, r.buf.as<uint16_t>() + at, g.scale, dst, n, config_.dtype);
    else
      be_.accumulate_16(r.buf.as<float>() + at, nullptr, g.scale, dst, n, config_.dtype);
  } else if (r.half) {
    // fp16/bf16 compression: widened, then added.
    Buffer f = be_.alloc(f32_bytes(n), MemCategory::kComm, false);
    be_.widen_16(r.buf.as<uint16_t>() + at, f.as<float>(), n, wire());
    be_.axpy(target_.f32 + shards_.shard_offset(u), g.scale, f.as<float>(), n);
  } else {
    be_.axpy(target_.f32 + shards_.shard_offset(u), g.scale, r.buf.as<float>() + at, n);
  }
  reducing_elements_ -= shards_.unit(u).size();
  reducing_.pop_front();
}

std::unique_ptr<GradReducer> make_grad_reducer(ParamStore<float>& store, const ShardLayout& shards,
                                               const ZeroConfig& config, GradTarget target) {
  if (config.compression.type == "powersgd")
    return make_powersgd_reducer(store, shards, config, target);
  if (config.stage >= 2) return std::make_unique<UnitReduceScatter>(store, shards, config, target);
  return std::make_unique<BucketedAllReduce>(store, shards, config, target);
}

}  // namespace loom
