// Megatron-LM's paired communication regions over the tensor-parallel group,
// each a forward and a backward that mirror each other:
//   copy to region      forward identity       backward all-reduce (sum)
//   reduce from region  forward all-reduce     backward identity
// A column-parallel linear opens a region (its input is copied to every
// rank, so the input's gradient is summed in backward); a row-parallel
// linear closes it (the partial products are summed in forward). A null
// group, or one of one rank, makes every call a no-op.
#pragma once

#include <cstdint>
#include <memory>

#include "loom/comm/process_group.h"
#include "loom/kernels/backend.h"
#include "loom/nn/context.h"

namespace loom::tp {

// Time spent in the group's collectives (all blocking: the layer waits for
// each) since the last take(); the bytes are in the record (comm/record.h).
struct Traffic {
  double seconds = 0;
};

class Group {
 public:
  // payload: the type the layers' tensors travel in (kF32, or a 16-bit
  // run's bf16: rounded on `backend` before each collective, widened after).
  explicit Group(std::shared_ptr<ProcessGroup> g, DType payload = DType::kF32,
                 const Backend<float>* backend = nullptr);
  int rank() const { return g_ ? g_->rank() : 0; }
  int size() const { return g_ ? g_->size() : 1; }
  const std::shared_ptr<ProcessGroup>& process_group() const { return g_; }
  DType payload() const { return payload_; }

  // Statistics (row maxima, sums of exponentials), in place over the group,
  // waited for, in f32 whatever the payload type.
  void sum(float* x, int64_t n) const;
  void max(float* x, int64_t n) const;
  // The layers' tensors (activations and their gradients), in the payload
  // type; the sum adds in f32 (rounded once to the payload type).
  void sum_tensor(float* x, int64_t n) const;
  // Sequence parallelism's pair, over rows split in rank order:
  //   gather          all (size * n) = every rank's local (n), in rank order
  //   reduce_scatter  local (n) = the sum over ranks of block `rank` of all (size * n)
  void gather(const float* local, float* all, int64_t n) const;
  void reduce_scatter(const float* all, float* local, int64_t n) const;
  // The traffic of this group (shared by its copies) since the last call.
  Traffic take_traffic() const;

 private:
  void all_reduce(float* x, int64_t n, ReduceOp op, DType t) const;
  // Times one blocking collective into the traffic.
  template <class F>
  void timed(F collective) const;
  bool half() const { return payload_ != DType::kF32; }
  std::shared_ptr<ProcessGroup> g_;
  DType payload_ = DType::kF32;
  const Backend<float>* be_ = nullptr;
  std::shared_ptr<Traffic> traffic_;
};

// The input gradient of a copy-to region (backward of a column-parallel
// linear's input): dx (n) = sum over the group, in place.
inline void copy_to_region_backward(const Group& g, float* dx, int64_t n) {
  g.sum_tensor(dx, n);
}
// The output of a reduce-from region (forward of a row-parallel linear):
// y (n) = sum over the group of the partial products, in place.
inline void reduce_from_region_forward(const Group& g, float* y, int64_t n) {
  g.sum_tensor(y, n);
}

// A block half's backward (attention or MLP) under both schemes.
// Opening: with the sequence split, the output gradient and the input
// (rows.count, C) are gathered into (rows.all(), C) buffers taken from `a`.
void gather_for_backward(const Group& g, const Rows& rows, int64_t C, const float*& dout,
                         const float*& x, Arena<float>& a);
// Closing the copy-to region: dx (rows.count, C) = the group's sum of the
// partial input gradient d_all (rows.all(), C), reduce-scattered into dx
// when the sequence is split, else all-reduced in place and copied.
void set_input_gradient(const Backend<float>& be, const Group& g, const Rows& rows, int64_t C,
                        float* dx, float* d_all);

}  // namespace loom::tp
