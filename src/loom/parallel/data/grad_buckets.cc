#include "loom/parallel/data/grad_buckets.h"

#include <algorithm>
#include <chrono>
#include <exception>

#include "loom/core/error.h"

namespace loom {

GradBuckets::GradBuckets(const ParamLayout& layout, std::vector<BucketGroup> groups,
                         int64_t bucket_elements, bool overlap, const Backend<float>& backend)
    : overlap_(overlap), be_(&backend) {
  LOOM_CHECK_KIND(kConfig, bucket_elements > 0,
                  "zero_optimization.reduce_bucket_size must be > 0, got {}", bucket_elements);
  LOOM_CHECK(groups.size() == layout.units().size(), "{} bucket groups for {} units", groups.size(),
             layout.units().size());
  // Units reduced alike share an entry: one for the dense units, one for the
  // expert units.
  std::vector<int> of_unit;
  for (const BucketGroup& g : groups) {
    int k = 0;
    while (k < static_cast<int>(groups_.size()) &&
           (groups_[static_cast<size_t>(k)].group != g.group ||
            groups_[static_cast<size_t>(k)].scale != g.scale))
      ++k;
    if (k == static_cast<int>(groups_.size())) groups_.push_back(g);
    of_unit.push_back(k);
  }
  // Walk parameters from the last to the first; cut a bucket once it holds
  // at least bucket_elements, or where the group changes. Parameters are
  // contiguous in the flat buffer, so each bucket is one range (alignment
  // padding included, zero on every rank).
  const auto& ps = layout.params();
  int64_t end = layout.total();
  for (size_t i = ps.size(); i-- > 0;) {
    const int64_t begin = ps[i].offset;
    const int g = of_unit[static_cast<size_t>(ps[i].unit)];
    if (end - begin >= bucket_elements || i == 0 ||
        of_unit[static_cast<size_t>(ps[i - 1].unit)] != g) {
      buckets_.push_back({begin, end, g, nullptr});
      end = begin;
    }
  }
}

GradBuckets::~GradBuckets() {
  for (auto& b : buckets_) {
    // See ~ZeroEngine: no waiting on peers while an error unwinds.
    if (b.work && !b.work->test() && std::uncaught_exceptions() > 0)
      fail_fast(format("{} (a gradient all-reduce was still in flight)", last_error()));
    try {
      if (b.work) b.work->wait();
    } catch (...) {  // reported where it failed
    }
  }
}

void GradBuckets::begin(void* grads, DType t) {
  grads_ = static_cast<char*>(grads);
  dtype_ = t;
  next_ = 0;
  for (auto& b : buckets_) b.work = nullptr;
}

void GradBuckets::launch(Bucket& b) {
  const BucketGroup& g = groups_[static_cast<size_t>(b.group)];
  if (g.group)
    b.work = g.group->all_reduce(at(b.begin), at(b.begin), static_cast<size_t>(b.end - b.begin),
                                 dtype_, ReduceOp::kAvg);
}

void GradBuckets::ready_from(int64_t from) {
  if (!overlap_ || grads_ == nullptr) return;
  while (next_ < buckets_.size() && buckets_[next_].begin >= from) launch(buckets_[next_++]);
}

BucketStats GradBuckets::finish() {
  LOOM_CHECK(grads_ != nullptr, "GradBuckets::finish() without begin()");
  while (next_ < buckets_.size()) launch(buckets_[next_++]);
  BucketStats s;
  auto t0 = std::chrono::steady_clock::now();
  for (auto& b : buckets_) {
    const BucketGroup& g = groups_[static_cast<size_t>(b.group)];
    if (b.work) {
      b.work->wait();
      s.comm_s += b.work->seconds();
    }
    if (g.scale == 1.0f) continue;
    if (dtype_ == DType::kF32)
      be_->scale(reinterpret_cast<float*>(at(b.begin)), b.end - b.begin, g.scale);
    else
      be_->scale_16(reinterpret_cast<uint16_t*>(at(b.begin)), b.end - b.begin, g.scale, dtype_);
  }
  s.exposed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  grads_ = nullptr;
  return s;
}

}  // namespace loom
