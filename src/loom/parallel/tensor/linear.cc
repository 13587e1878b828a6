#include "loom/parallel/tensor/linear.h"
#include "loom/nn/deferred_grads.h"

#include <vector>

#include "loom/core/error.h"

namespace loom::tp {

ColumnParallelLinear::ColumnParallelLinear(ParamLayout& layout, const std::string& prefix,
                                           int64_t in, int64_t out, float std, const Group& g,
                                           int blocks)
    : in_(in), out_(out), size_(g.size()), blocks_(blocks), g_(g) {
  const ShardSpec w = blocks > 1 ? ShardSpec::heads(1, g.rank(), g.size(), blocks)
                                 : ShardSpec::split(1, g.rank(), g.size());
  const ShardSpec b = blocks > 1 ? ShardSpec::heads(0, g.rank(), g.size(), blocks)
                                 : ShardSpec::split(0, g.rank(), g.size());
  weight = layout.add(prefix + ".weight", {in, out}, true, ParamInit{std}, w);
  bias = layout.add(prefix + ".bias", {out}, false, ParamInit{}, b);
}

void ColumnParallelLinear::forward(const ParamStore<float>& ps, float* y, const float* x,
                                   int64_t N) const {
  const auto& be = ps.backend();
  be.matmul_forward(y, x, ps.weight(weight), ps.param(bias), N, in_, local_out());
}

void ColumnParallelLinear::backward(const ParamStore<float>& ps, float* dx_partial, const float* dy,
                                    const float* x, int64_t N, GradWrite dx_write) const {
  linear_backward(ps, dx_partial, weight, bias, dy, x, N, in_, local_out(), dx_write);
}

void ColumnParallelLinear::forward_gathered(const ParamStore<float>& ps, float* y, const float* x,
                                            int64_t N) const {
  LOOM_CHECK(blocks_ == 1, "a gathered output needs a plain column split");
  const int64_t ol = local_out();
  std::vector<float> mine(static_cast<size_t>(N * ol)), all(static_cast<size_t>(N * out_));
  forward(ps, mine.data(), x, N);
  g_.gather(mine.data(), all.data(), N * ol);
  // all holds rank r's (N, out/tp) block r: its columns of y.
  for (int r = 0; r < size_; ++r)
    shard_to_global(Shape{N, out_}, ShardSpec::split(1, r, size_), all.data() + r * N * ol, y);
}

void ColumnParallelLinear::backward_gathered(const ParamStore<float>& ps, float* dx_partial,
                                             const float* dy, const float* x, int64_t N) const {
  LOOM_CHECK(blocks_ == 1, "a gathered output needs a plain column split");
  std::vector<float> mine(static_cast<size_t>(N * local_out()));
  shard_from_global(Shape{N, out_}, ShardSpec::split(1, g_.rank(), size_), dy, mine.data());
  backward(ps, dx_partial, mine.data(), x, N);
}

RowParallelLinear::RowParallelLinear(ParamLayout& layout, const std::string& prefix, int64_t in,
                                     int64_t out, float std, const Group& g)
    : in_(in), out_(out), g_(g) {
  weight = layout.add(prefix + ".weight", {in, out}, true, ParamInit{std},
                      ShardSpec::split(0, g.rank(), g.size()));
  bias = layout.add(prefix + ".bias", {out}, false, ParamInit{});
}

void RowParallelLinear::forward(const ParamStore<float>& ps, float* y, const float* x_local,
                                int64_t N) const {
  const auto& be = ps.backend();
  be.matmul_forward(y, x_local, ps.weight(weight), static_cast<const float*>(nullptr), N,
                    local_in(), out_);
  reduce_from_region_forward(g_, y, N * out_);
  be.bias_add(y, ps.param(bias), N, out_);
}

void RowParallelLinear::forward_rows(const ParamStore<float>& ps, float* y_rows,
                                     const float* x_local, int64_t N, float* partial) const {
  const auto& be = ps.backend();
  be.matmul_forward(partial, x_local, ps.weight(weight), static_cast<const float*>(nullptr), N,
                    local_in(), out_);
  const int64_t n = N / g_.size();
  g_.reduce_scatter(partial, y_rows, n * out_);
  be.bias_add(y_rows, ps.param(bias), n, out_);
}

void RowParallelLinear::backward(const ParamStore<float>& ps, float* dx_local, const float* dy,
                                 const float* x_local, int64_t N, GradWrite dx_write) const {
  linear_backward(ps, dx_local, weight, bias, dy, x_local, N, local_in(), out_, dx_write);
}

}  // namespace loom::tp
