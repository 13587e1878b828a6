// Causal multi-head self-attention as GPT-2 has it: the fused q|k|v
// projection (c_attn), the attention core (scores, softmax, dropout on the
// probabilities, the weighted sum of values; kernels/cpu/attention.h), and the
// output projection (c_proj). The core never stores the (T, T) scores: it
// keeps its output and one log-sum-exp per query, which is also what a
// selective recomputation drops and recomputes from q|k|v.
#pragma once

#include <cstdint>
#include <string>

#include "loom/nn/context.h"
#include "loom/nn/param_store.h"

namespace loom {

template <typename T>
class Attention {
 public:
  // Declares <prefix>.c_attn.{weight,bias} (C, 3C) (3C) and
  // <prefix>.c_proj.{weight,bias} (C, C) (C); c_proj is drawn with proj_std.
  Attention(ParamLayout& layout, const std::string& prefix, const GptConfig& c, float proj_std);
  ParamId c_attn_w, c_attn_b, c_proj_w, c_proj_b;

  // What forward keeps for backward: qkv (B,T,3C) in the record, and the
  // core's output y (B,T,C) and lse (B,NH,T) there too, or, when
  // `selective`, in the stage's shared recompute room (backward recomputes them).
  struct Record {
    T *qkv, *y, *lse;
  };
  Record bind(Arena<T>& record, Arena<T>& recompute, int64_t B, int64_t Tn, bool selective) const;
  // Backward's gradient scratch.
  int64_t scratch_elems(int64_t B, int64_t Tn) const;

  // out (B,T,C) = c_proj(core(c_attn(x))), x (B,T,C) the normalised input.
  void forward(const ParamStore<T>& ps, const Record& r, T* out, const T* x, int64_t B, int64_t Tn,
               const cpu::DropoutSpec& probs) const;
  // Accumulates dx (B,T,C) and the parameter gradients from dout (B,T,C).
  void backward(const ParamStore<T>& ps, const Record& r, T* dx, const T* dout, const T* x,
                int64_t B, int64_t Tn, const cpu::DropoutSpec& probs, bool selective,
                T* scratch) const;

 private:
  int64_t C_, NH_;
};

}  // namespace loom
