// The block's attention and feed-forward slots split across the
// tensor-parallel group as Megatron-LM splits them: one all-reduce in
// forward (closing the region after the row-parallel projection) and one in
// backward (the input gradient of the column-parallel projection) per half.
//
//   ParallelAttention  c_attn column-parallel by heads: a rank holds n_head/tp
//                      whole heads of q, k and v and runs the attention core
//                      on them alone (dropout masks keyed on the global head);
//                      c_proj row-parallel.
//   ParallelMlp        c_fc column-parallel, GELU local, c_proj row-parallel.
//
// With the sequence split (sequence parallelism) their input and output are
// this rank's rows only: the input is gathered along the sequence before the
// column-parallel projection (and gathered again in backward for its weight
// gradient, rather than kept), and the row-parallel output is
// reduce-scattered back to the rows; the input gradient is reduce-scattered.
#pragma once

#include <cstdint>
#include <string>

#include "loom/nn/attention.h"
#include "loom/nn/mlp.h"
#include "loom/parallel/tensor/linear.h"

namespace loom::tp {

class ParallelAttention final : public AttentionLayer<float> {
 public:
  ParallelAttention(ParamLayout& layout, const std::string& prefix, const GptConfig& c,
                    float proj_std, const Group& g,
                    std::shared_ptr<const AttentionCore<float>> core = nullptr);
  int64_t record_elems(const Rows& rows, bool selective) const override;
  int64_t recompute_elems(const Rows& rows, bool selective) const override;
  std::vector<RecordRange> exact_ranges(const Rows& rows, bool selective) const override;
  int64_t scratch_elems(const Rows& rows) const override;
  void forward(const ParamStore<float>& ps, float* record, bool selective, float* out,
               const float* x, const Rows& rows, const DropoutSpec& probs,
               float* recompute) const override;
  void backward(const ParamStore<float>& ps, float* record, bool selective, float* dx,
                const float* dout, const float* x, const Rows& rows, const DropoutSpec& probs,
                float* scratch, float* recompute) const override;

 private:
  struct Record {
    float *qkv, *y, *lse;  // (B,T,3C/tp) (B,T,C/tp) (B,NH/tp,T)
  };
  Record bind(float* record, float* recompute, int64_t B, int64_t Tn, bool selective) const;
  DropoutSpec local_heads(DropoutSpec probs) const;
  Group g_;
  int64_t C_, Cl_, NHl_;  // width, this rank's width and heads
  ColumnParallelLinear c_attn_;
  RowParallelLinear c_proj_;
  std::shared_ptr<const AttentionCore<float>> core_;  // null: the backend's
};

class ParallelMlp final : public FeedForward<float> {
 public:
  ParallelMlp(ParamLayout& layout, const std::string& prefix, int64_t C, float proj_std,
              const Group& g);
  int64_t record_elems(const Rows& rows, bool selective) const override;
  int64_t recompute_elems(const Rows& rows, bool selective) const override;
  std::vector<RecordRange> exact_ranges(const Rows&, bool) const override { return {}; }
  int64_t scratch_elems(const Rows& rows) const override;
  void forward(const ParamStore<float>& ps, float* record, bool selective, float* out,
               const float* x, const Rows& rows, float* recompute) const override;
  void backward(const ParamStore<float>& ps, float* record, bool selective, float* dx,
                const float* dout, const float* x, const Rows& rows, float* scratch,
                float* recompute) const override;

 private:
  Group g_;
  int64_t C_, Hl_;  // width, this rank's hidden features (4C/tp)
  ColumnParallelLinear c_fc_;
  RowParallelLinear c_proj_;
};

}  // namespace loom::tp
