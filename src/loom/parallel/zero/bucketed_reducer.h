// The bucketed all-reduce of stages 0-1 and the per-unit reduce-scatter of
// stages 2-3 (grad_reducer.h), declared here so that the compressing
// reducers (powersgd.cc) reuse them: internal to parallel/zero.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "loom/parallel/zero/grad_reducer.h"

namespace loom {

// What every reducer shares: the store, the split, the target, and the
// per-unit f32 buffers backward writes into where the target is not the
// store's own gradients.
class ReducerBase : public GradReducer {
 protected:
  ReducerBase(ParamStore<float>& store, const ShardLayout& shards, const ZeroConfig& config,
              GradTarget target);

  bool half() const { return config_.dtype != DType::kF32; }
  // The element type gradients cross the wire in: the run's, or 16 bits
  // where comm.compression is fp16 or bf16.
  DType wire() const { return wire_; }
  size_t pbytes(int64_t elements) const {
    return static_cast<size_t>(elements) * dtype_size(config_.dtype);
  }
  Buffer& buf(int u) { return bufs_[static_cast<size_t>(u)]; }
  void bind(int u);
  Buffer unbind(int u);

  ParamStore<float>& store_;
  const Backend<float>& be_;
  const ShardLayout& shards_;
  const ZeroConfig& config_;
  GradTarget target_;
  DType wire_;
  std::vector<Buffer> bufs_;  // per unit, while backward writes it
};

class BucketedAllReduce : public ReducerBase {
 public:
  BucketedAllReduce(ParamStore<float>& store, const ShardLayout& shards, const ZeroConfig& config,
                    GradTarget target);
  ~BucketedAllReduce() override;

  void begin(bool reduce, bool last) override;
  void acquire(int u) override;
  void written(int u) override;
  void final(int u) override;
  void end() override;

 protected:
  struct Bucket {
    int64_t begin, end;  // elements [begin, end) of the flat gradients
    int group;           // its entry of groups_
    WorkPtr work;
    Buffer wire;  // fp16/bf16 compression: the 16-bit copy on the wire
  };
  // Starts bucket b's reduction (the plain all-reduce here).
  virtual void launch(Bucket& b);
  // Waits for every bucket's reduction and leaves the averages in the
  // target (scaled by the group's scale).
  virtual void complete();
  const UnitGroup& group_of(const Bucket& b) const {
    return *groups_[static_cast<size_t>(b.group)];
  }
  // The bucket's gradients in the target.
  void* at(const Bucket& b) const {
    return half() ? static_cast<void*>(target_.h16 + b.begin)
                  : static_cast<void*>(target_.f32 + b.begin);
  }
  // Multiplies the bucket's gradients in the target by s.
  void scale(const Bucket& b, float s) const;

  std::vector<const UnitGroup*> groups_;
  std::vector<Bucket> buckets_;  // in launch order: highest offsets first
  size_t next_ = 0;              // first bucket not launched
  bool reduce_ = false;
};

// Stages 2-3: each unit's gradients reduce-scattered into the shard as soon
// as backward has written them, every micro-batch; the newest reduction
// stays in flight while the next unit's backward runs.
class UnitReduceScatter : public ReducerBase {
 public:
  UnitReduceScatter(ParamStore<float>& store, const ShardLayout& shards, const ZeroConfig& config,
                    GradTarget target)
      : ReducerBase(store, shards, config, target) {}
  ~UnitReduceScatter() override;

  void begin(bool, bool) override {}
  void acquire(int u) override;
  void written(int u) override;
  void final(int) override {}
  void end() override;

 protected:
  struct Reducing {
    int unit;
    Buffer buf;    // f32 (the unit's whole gradients), or 16-bit when `half`
    WorkPtr work;  // null: buf already holds the reduced gradients
    bool half = false;
  };
  // Waits for the oldest reduction and adds its slice into the shard's
  // gradients (accumulating over micro-batches, each already scaled by
  // 1 / accumulation).
  void drain_one();

  std::deque<Reducing> reducing_;  // launched reduce-scatters, oldest first
  int64_t reducing_elements_ = 0;
};

// PowerSGD over the bucketed all-reduce's buckets (stages 0-1) or the
// units of the reduce-scatter (stages 2-3) (powersgd.cc).
std::unique_ptr<GradReducer> make_powersgd_reducer(ParamStore<float>& store,
                                                   const ShardLayout& shards,
                                                   const ZeroConfig& config, GradTarget target);

}  // namespace loom
