#include "loom/parallel/data/grad_buckets.h"

#include <algorithm>
#include <chrono>

#include "loom/core/error.h"

namespace loom {

GradBuckets::GradBuckets(const ParamLayout& layout, std::shared_ptr<ProcessGroup> group,
                         int64_t bucket_elements, bool overlap)
    : group_(std::move(group)), overlap_(overlap) {
  LOOM_CHECK_KIND(kConfig, bucket_elements > 0,
                  "zero_optimization.reduce_bucket_size must be > 0, got {}", bucket_elements);
  // Walk parameters from the last to the first; cut a bucket once it holds
  // at least bucket_elements. Parameters are contiguous in the flat buffer, so
  // each bucket is one range (alignment padding included, zero on every rank).
  const auto& ps = layout.params();
  int64_t end = layout.total();
  for (size_t i = ps.size(); i-- > 0;) {
    int64_t begin = ps[i].offset;
    if (end - begin >= bucket_elements || i == 0) {
      buckets_.push_back({begin, end, nullptr});
      end = begin;
    }
  }
}

GradBuckets::~GradBuckets() {
  for (auto& b : buckets_) {
    try {
      if (b.work) b.work->wait();
    } catch (...) {  // reported where it failed
    }
  }
}

void GradBuckets::begin(float* grads) {
  grads_ = grads;
  next_ = 0;
  for (auto& b : buckets_) b.work = nullptr;
}

void GradBuckets::launch(Bucket& b) {
  b.work = group_->all_reduce(grads_ + b.begin, grads_ + b.begin,
                              static_cast<size_t>(b.end - b.begin), DType::kF32, ReduceOp::kAvg);
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
    b.work->wait();
    s.comm_s += b.work->seconds();
    s.bytes += 2.0 * (group_->size() - 1) / group_->size() * double(b.end - b.begin) * 4.0;
  }
  s.exposed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  grads_ = nullptr;
  return s;
}

}  // namespace loom
