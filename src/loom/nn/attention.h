// Causal multi-head self-attention as GPT-2 has it: the fused q|k|v
// projection (c_attn), the attention core (scores, softmax, dropout on the
// probabilities, the weighted sum of values; kernels/cpu/attention.h), and the
// output projection (c_proj). The core never stores the (T, T) scores: it
// keeps its output and one log-sum-exp per query, which is also what a
// selective recomputation drops and recomputes from q|k|v.
//
// AttentionLayer is the block's attention slot; Attention fills it in one
// process, and parallel/tensor's ParallelAttention with heads split across
// the tensor-parallel group.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/nn/context.h"
#include "loom/nn/param_store.h"

namespace loom {

// The attention core between the projections: y (B, Tn, C) and lse
// (B, NH, Tn) from this rank's q|k|v (B, Tn, 3C) of NH heads, and back.
// Without one a layer runs the backend's kernel over its whole sequence;
// context parallelism's (parallel/context) attends this rank's chunks to
// every rank's keys and values. lse is the core's own: a core may lay it
// out as it likes, in B x NH x Tn elements.
template <typename T>
class AttentionCore {
 public:
  virtual ~AttentionCore() = default;
  virtual void forward(const Backend<T>& be, T* y, T* lse, const T* qkv, int64_t B, int64_t Tn,
                       int64_t C, int64_t NH, const DropoutSpec& probs) const = 0;
  // dqkv (B, Tn, 3C) += from dy, given forward's y and lse.
  virtual void backward(const Backend<T>& be, T* dqkv, const T* dy, const T* qkv, const T* y,
                        const T* lse, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                        const DropoutSpec& probs) const = 0;
};

// The core a layer runs: `core`, or the backend's kernel over the whole sequence.
template <typename T>
void attention_core_forward(const AttentionCore<T>* core, const Backend<T>& be, T* y, T* lse,
                            const T* qkv, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                            const DropoutSpec& probs) {
  if (core)
    core->forward(be, y, lse, qkv, B, Tn, C, NH, probs);
  else
    be.attention_forward(y, lse, qkv, B, Tn, C, NH, probs);
}

// dqkv (B, Tn, 3C) written over whatever it held: a core's chunks add into
// it, so it is zeroed for them first; the backend's kernel writes it whole.
template <typename T>
void attention_core_backward(const AttentionCore<T>* core, const Backend<T>& be, T* dqkv,
                             const T* dy, const T* qkv, const T* y, const T* lse, int64_t B,
                             int64_t Tn, int64_t C, int64_t NH, const DropoutSpec& probs) {
  if (core) {
    be.fill(dqkv, B * Tn * 3 * C, T(0));
    core->backward(be, dqkv, dy, qkv, y, lse, B, Tn, C, NH, probs);
  } else
    be.attention_backward(dqkv, dy, qkv, y, lse, B, Tn, C, NH, probs);
}

template <typename T>
class AttentionLayer {
 public:
  virtual ~AttentionLayer() = default;
  // Elements one micro-batch keeps; `selective` leaves the core's output
  // and log-sum-exp to the stage's shared recompute room.
  virtual int64_t record_elems(const Rows& rows, bool selective) const = 0;
  virtual int64_t recompute_elems(const Rows& rows, bool selective) const = 0;
  // What of the record stays f32 in a 16-bit record: the log-sum-exp.
  virtual std::vector<RecordRange> exact_ranges(const Rows& rows, bool selective) const = 0;
  // With records packed to bf16 (RecordTwins): the record's ranges read in
  // bf16 alone, by the layer's own 16-bit kernel forms (the attention
  // core's) and, when linears16 (a backend whose GEMMs read bf16 inputs),
  // by a linear's GEMMs; and whether the normalised input x goes to the
  // layer's linears alone (a twin when linears16). The layer finds their
  // bf16 homes through ParamStore::input.
  virtual std::vector<RecordRange> twin_ranges(const Rows&, bool, bool) const { return {}; }
  virtual bool input_twin() const { return false; }
  // Ranges a linear's GEMM reads in bf16 and another kernel of backward in
  // f32 ("shared" twins, linears16 alone): the linear's forward rounds them into the slot
  // (pack leaves them), unpack widens them for that kernel, and the linear's
  // backward reads the slot.
  virtual std::vector<RecordRange> shared_twin_ranges(const Rows&, bool) const { return {}; }
  // Backward's gradient scratch.
  virtual int64_t scratch_elems(const Rows& rows) const = 0;
  // out (rows.count, C) = c_proj(core(c_attn(x))), x (rows.count, C) the
  // normalised input; `probs` keys the dropout masks on the probabilities.
  virtual void forward(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
                       const Rows& rows, const DropoutSpec& probs, T* recompute) const = 0;
  // Writes dx (rows.count, C) over what it held (the caller need not zero
  // it) and accumulates the parameter gradients, from dout.
  virtual void backward(const ParamStore<T>& ps, T* record, bool selective, T* dx, const T* dout,
                        const T* x, const Rows& rows, const DropoutSpec& probs, T* scratch,
                        T* recompute) const = 0;
};

template <typename T>
class Attention final : public AttentionLayer<T> {
 public:
  // Declares <prefix>.c_attn.{weight,bias} (C, 3C) (3C) and
  // <prefix>.c_proj.{weight,bias} (C, C) (C); c_proj is drawn with proj_std.
  // core: the attention core (null: the backend's over the whole sequence).
  Attention(ParamLayout& layout, const std::string& prefix, const GptConfig& c, float proj_std,
            std::shared_ptr<const AttentionCore<T>> core = nullptr);
  ParamId c_attn_w, c_attn_b, c_proj_w, c_proj_b;

  int64_t record_elems(const Rows& rows, bool selective) const override;
  int64_t recompute_elems(const Rows& rows, bool selective) const override;
  std::vector<RecordRange> exact_ranges(const Rows& rows, bool selective) const override;
  // x goes to c_attn alone; q|k|v to the core alone (read in bf16 by its
  // 16-bit forms, Backend::attention_forward_16), unless a context-parallel
  // core takes them or selective recomputes the core from f32 q|k|v; the
  // core's output y to c_proj and to the core's backward (a shared twin).
  bool input_twin() const override { return true; }
  std::vector<RecordRange> twin_ranges(const Rows& rows, bool selective,
                                       bool linears16) const override;
  std::vector<RecordRange> shared_twin_ranges(const Rows& rows, bool selective) const override;
  int64_t scratch_elems(const Rows& rows) const override;
  void forward(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
               const Rows& rows, const DropoutSpec& probs, T* recompute) const override;
  void backward(const ParamStore<T>& ps, T* record, bool selective, T* dx, const T* dout,
                const T* x, const Rows& rows, const DropoutSpec& probs, T* scratch,
                T* recompute) const override;

 private:
  // The record: qkv (B,T,3C), then y (B,T,C) and lse (B,NH,T), which go to
  // the recompute room instead when selective.
  struct Record {
    T *qkv, *y, *lse;
  };
  Record bind(T* record, T* recompute, int64_t B, int64_t Tn, bool selective) const;
  int64_t C_, NH_;
  std::shared_ptr<const AttentionCore<T>> core_;
};

}  // namespace loom
