#include "loom/parallel/tensor/regions.h"

namespace loom::tp {

void Group::sum(float* x, int64_t n) const {
  if (size() == 1 || n == 0) return;
  g_->all_reduce(x, x, static_cast<size_t>(n), DType::kF32, ReduceOp::kSum)->wait();
}

void Group::max(float* x, int64_t n) const {
  if (size() == 1 || n == 0) return;
  g_->all_reduce(x, x, static_cast<size_t>(n), DType::kF32, ReduceOp::kMax)->wait();
}

}  // namespace loom::tp
