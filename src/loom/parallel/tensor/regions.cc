#include "loom/parallel/tensor/regions.h"

#include <algorithm>
#include <chrono>

#include "loom/core/clock.h"
#include "loom/core/error.h"

namespace loom::tp {

Group::Group(std::shared_ptr<ProcessGroup> g, DType payload, const Backend<float>* backend)
    : g_(std::move(g)), payload_(payload), be_(backend), traffic_(std::make_shared<Traffic>()) {
  LOOM_CHECK(payload_ == DType::kF32 ||
                 ((payload_ == DType::kBF16 || payload_ == DType::kF16) && be_ != nullptr),
             "tensor-parallel payloads travel in f32, or in bf16 or f16 with a backend");
}

template <class F>
void Group::timed(F collective) const {
  const auto t0 = std::chrono::steady_clock::now();
  collective();
  traffic_->seconds += seconds_since(t0);
}

void Group::all_reduce(float* x, int64_t n, ReduceOp op, DType t) const {
  if (size() == 1 || n == 0) return;
  const size_t count = static_cast<size_t>(n);
  if (t == DType::kF32) {
    timed([&] { g_->all_reduce(x, x, count, DType::kF32, op)->wait(); });
    return;
  }
  Buffer h = be_->alloc(count * 2, MemCategory::kComm, false);  // all written next
  be_->round_16(x, h.as<uint16_t>(), n, t);
  timed([&] { g_->all_reduce(h.data(), h.data(), count, t, op)->wait(); });
  be_->widen_16(h.as<uint16_t>(), x, n, t);
}

void Group::sum(float* x, int64_t n) const {
  all_reduce(x, n, ReduceOp::kSum, DType::kF32);
}

void Group::max(float* x, int64_t n) const {
  all_reduce(x, n, ReduceOp::kMax, DType::kF32);
}

void Group::sum_tensor(float* x, int64_t n) const {
  all_reduce(x, n, ReduceOp::kSum, payload_);
}

void Group::gather(const float* local, float* all, int64_t n) const {
  if (size() == 1) {
    std::copy(local, local + n, all);
    return;
  }
  const size_t count = static_cast<size_t>(n);
  if (!half()) {
    timed([&] { g_->all_gather(local, all, count, DType::kF32)->wait(); });
    return;
  }
  const int64_t total = n * size();
  Buffer h = be_->alloc(static_cast<size_t>(total) * 2, MemCategory::kComm, false);
  uint16_t* mine = h.as<uint16_t>() + n * rank();
  be_->round_16(local, mine, n, payload_);
  timed([&] { g_->all_gather(mine, h.data(), count, payload_)->wait(); });
  be_->widen_16(h.as<uint16_t>(), all, total, payload_);
}

void Group::reduce_scatter(const float* all, float* local, int64_t n) const {
  if (size() == 1) {
    std::copy(all, all + n, local);
    return;
  }
  const size_t count = static_cast<size_t>(n);
  if (!half()) {
    timed([&] { g_->reduce_scatter(all, local, count, DType::kF32, ReduceOp::kSum)->wait(); });
    return;
  }
  const int64_t total = n * size();
  Buffer h = be_->alloc(static_cast<size_t>(total) * 2, MemCategory::kComm, false);
  be_->round_16(all, h.as<uint16_t>(), total, payload_);
  Buffer r = be_->alloc(count * 2, MemCategory::kComm, false);
  timed([&] { g_->reduce_scatter(h.data(), r.data(), count, payload_, ReduceOp::kSum)->wait(); });
  be_->widen_16(r.as<uint16_t>(), local, n, payload_);
}

Traffic Group::take_traffic() const {
  Traffic t = *traffic_;
  *traffic_ = Traffic{};
  return t;
}

void gather_for_backward(const Group& g, const Rows& rows, int64_t C, const float*& dout,
                         const float*& x, Arena<float>& a) {
  if (!rows.split()) return;
  float* dout_all = a.take(rows.all() * C);
  float* x_all = a.take(rows.all() * C);
  g.gather(dout, dout_all, rows.count * C);
  g.gather(x, x_all, rows.count * C);
  dout = dout_all, x = x_all;
}

void set_input_gradient(const Backend<float>& be, const Group& g, const Rows& rows, int64_t C,
                        float* dx, float* d_all) {
  if (rows.split()) {
    g.reduce_scatter(d_all, dx, rows.count * C);
    return;
  }
  copy_to_region_backward(g, d_all, rows.count * C);
  be.copy(dx, d_all, rows.count * C);
}

}  // namespace loom::tp
