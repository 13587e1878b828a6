// Linear layers split across the tensor-parallel group. Weights are stored
// (in, out) as GPT-2's Conv1D does, under their full global names with a
// shard spec, so each rank's slice initialises to its part of the
// single-process tensor and checkpoints assemble the whole one.
//
//   ColumnParallelLinear  weight split by output features (columns; or by
//                         heads for the fused q|k|v), bias split alike: each
//                         rank computes its own output features from the
//                         whole input; the input gradient is a partial sum
//                         (the caller closes the copy-to region).
//   RowParallelLinear     weight split by input features (rows), bias whole:
//                         each rank multiplies its slice of the input, the
//                         partial products are summed (reduce-from region),
//                         then the bias is added once.
#pragma once

#include <cstdint>
#include <string>

#include "loom/nn/param_store.h"
#include "loom/parallel/tensor/regions.h"

namespace loom::tp {

class ColumnParallelLinear {
 public:
  // heads: the output is `blocks` equal blocks (q|k|v) each split by heads.
  ColumnParallelLinear(ParamLayout& layout, const std::string& prefix, int64_t in, int64_t out,
                       float std, const Group& g, int blocks = 1);
  int64_t local_out() const { return out_ / size_; }
  // y (N, out/tp) = x (N, in) @ W_local + b_local.
  void forward(const ParamStore<float>& ps, float* y, const float* x, int64_t N) const;
  // dx_partial (N, in) += dy (N, out/tp) @ W_local^T (= with kSet);
  // accumulates the weight and bias gradients.
  void backward(const ParamStore<float>& ps, float* dx_partial, const float* dy, const float* x,
                int64_t N, GradWrite dx_write = GradWrite::kAdd) const;
  // The same with the output gathered (column split only): y (N, out), every
  // rank's features in place; backward takes dy (N, out), whole on every
  // rank, and uses this rank's columns of it.
  void forward_gathered(const ParamStore<float>& ps, float* y, const float* x, int64_t N) const;
  void backward_gathered(const ParamStore<float>& ps, float* dx_partial, const float* dy,
                         const float* x, int64_t N) const;
  ParamId weight, bias;

 private:
  int64_t in_, out_;
  int size_, blocks_;
  Group g_;
};

class RowParallelLinear {
 public:
  RowParallelLinear(ParamLayout& layout, const std::string& prefix, int64_t in, int64_t out,
                    float std, const Group& g);
  int64_t local_in() const { return in_ / g_.size(); }
  // y (N, out) = sum over the group of x_local (N, in/tp) @ W_local, + b.
  void forward(const ParamStore<float>& ps, float* y, const float* x_local, int64_t N) const;
  // Sequence parallelism: y_rows (n, out) = this rank's n rows of that
  // sum (reduce-scattered along the rows), + b; `partial` is (N, out) scratch.
  void forward_rows(const ParamStore<float>& ps, float* y_rows, const float* x_local, int64_t N,
                    float* partial) const;
  // dx_local (N, in/tp) += dy (N, out) @ W_local^T (= with kSet);
  // accumulates the weight gradient and (the same on every rank) the bias
  // gradient.
  void backward(const ParamStore<float>& ps, float* dx_local, const float* dy, const float* x_local,
                int64_t N, GradWrite dx_write = GradWrite::kAdd) const;
  ParamId weight, bias;

 private:
  int64_t in_, out_;
  Group g_;
};

}  // namespace loom::tp
