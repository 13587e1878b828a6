// Data-parallel gradient reduction in buckets: contiguous ranges of the flat
// gradient buffer, formed in reverse parameter order (the order backward
// finishes them), each averaged across the data-parallel group with an
// asynchronous all-reduce as soon as backward has produced its last gradient,
// so communication overlaps the rest of backward. A bucket holds the
// parameters of units reduced over one group (expert units under expert
// parallelism have their own: BucketGroup).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/kernels/backend.h"
#include "loom/nn/param.h"

namespace loom {

struct BucketStats {
  double comm_s = 0;     // sum of the buckets' all-reduce times on the worker
  double exposed_s = 0;  // time the caller waited for them after backward
};

// Where a unit's gradients are averaged: over `group` (null: this rank
// alone), then multiplied by `scale`.
struct BucketGroup {
  std::shared_ptr<ProcessGroup> group;
  float scale = 1;
};

class GradBuckets {
 public:
  // groups: per unit of the layout. bucket_elements: DeepSpeed's
  // reduce_bucket_size (elements); overlap: start each bucket during
  // backward (else all after it).
  // Scaling after the reduction runs on `backend`.
  GradBuckets(const ParamLayout& layout, std::vector<BucketGroup> groups, int64_t bucket_elements,
              bool overlap, const Backend<float>& backend);
  // Waits for reductions still in flight: they write into the gradients.
  ~GradBuckets();

  // Before the backward whose gradients are final (the last micro-batch):
  // the flat gradients, f32 or 16-bit (reduced in 16 bits, accumulated in
  // f32 inside the collective).
  void begin(void* grads, DType t);
  // Backward reports that every gradient at offset >= `from` is final.
  void ready_from(int64_t from);
  // After backward: starts what is left, waits for all, returns the timings.
  BucketStats finish();

 private:
  struct Bucket {
    int64_t begin, end;  // elements [begin, end) of the flat buffer
    int group;           // its entry of groups_
    WorkPtr work;
  };
  void launch(Bucket& b);

  std::vector<BucketGroup> groups_;
  bool overlap_;
  const Backend<float>* be_;
  std::vector<Bucket> buckets_;  // in launch order: highest offsets first
  size_t next_ = 0;              // first bucket not launched
  char* grads_ = nullptr;
  DType dtype_ = DType::kF32;
  char* at(int64_t element) const { return grads_ + element * int64_t(dtype_size(dtype_)); }
};

}  // namespace loom
