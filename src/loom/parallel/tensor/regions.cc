#include "loom/parallel/tensor/regions.h"

#include <algorithm>
#include <chrono>

namespace loom::tp {

void Group::all_reduce(float* x, int64_t n, ReduceOp op) const {
  if (size() == 1 || n == 0) return;
  const auto t0 = std::chrono::steady_clock::now();
  g_->all_reduce(x, x, static_cast<size_t>(n), DType::kF32, op)->wait();
  traffic_->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // A ring all-reduce sends 2 (p - 1) / p of the buffer from every rank.
}

void Group::sum(float* x, int64_t n) const {
  all_reduce(x, n, ReduceOp::kSum);
}

void Group::max(float* x, int64_t n) const {
  all_reduce(x, n, ReduceOp::kMax);
}

void Group::gather(const float* local, float* all, int64_t n) const {
  if (size() == 1) {
    std::copy(local, local + n, all);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  g_->all_gather(local, all, static_cast<size_t>(n), DType::kF32)->wait();
  traffic_->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Group::reduce_scatter(const float* all, float* local, int64_t n) const {
  if (size() == 1) {
    std::copy(all, all + n, local);
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  g_->reduce_scatter(all, local, static_cast<size_t>(n), DType::kF32, ReduceOp::kSum)->wait();
  traffic_->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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

void add_input_gradient(const Backend<float>& be, const Group& g, const Rows& rows, int64_t C,
                        float* dx, float* d_all, Arena<float>& a) {
  float* mine = d_all;
  if (rows.split()) {
    mine = a.take(rows.count * C);
    g.reduce_scatter(d_all, mine, rows.count * C);
  } else {
    copy_to_region_backward(g, d_all, rows.count * C);
  }
  be.add(dx, mine, rows.count * C);
}

}  // namespace loom::tp
