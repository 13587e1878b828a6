// The backend table: every operation the layers, the parallel layers and the
// optimizer run on tensors, as one interface. A layer reaches the backend
// through the store it runs on (ParamStore::backend()), never a kernel
// directly, so a run computes wholly on the backend it was built with.
//
// Backends:
//   CpuBackend        the fast kernels (kernels/cpu): OpenBLAS or oneDNN GEMMs
//                     (its own choice, not the process's), vectorised loops,
//                     OpenMP; the only place loom's compute uses threads.
//   ReferenceBackend  the plainest loop for each definition, accumulating in
//                     double: the oracle every backend is tested against, op by
//                     op (tests/unit/test_backend_ops.cc), values and gradients.
// What a backend lacks answers supports(op) == false, and calling it throws
// Error(kUnsupported) "backend X does not support Y".
//
// Shapes are in comments, row-major; backward functions add into gradient
// buffers unless they say they overwrite. T is float (training) or double
// (gradient checks); the 16-bit operations exist for T = float only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "loom/core/dtype.h"
#include "loom/core/event.h"
#include "loom/core/memory.h"
#include "loom/kernels/types.h"

namespace loom {

enum class Op : uint8_t {
  kGemm,
  kMatmulForward,
  kMatmulBackward,
  kMatmulNtForward,
  kMatmulNtBackward,
  kLayerNormForward,
  kLayerNormBackward,
  kLayerNormForward16,
  kGeluForward,
  kGeluBackward,
  kGeluForward16,
  kGeluForwardRecord16,
  kGeluBackward16,
  kResidualForward,
  kAdd,
  kBiasAdd,
  kDropout,
  kDropoutResidual,
  kAttentionForward,
  kAttentionBackward,
  kAttentionForward16,
  kAttentionBackward16,
  kAttentionChunkForward,
  kAttentionChunkBackward,
  kCrossEntropyForward,
  kCrossEntropyBackward,
  kCrossEntropyBackward16,
  kVocabLogitStats,
  kVocabSumExp,
  kEncoderForward,
  kEncoderBackward,
  kEmbeddingLookup,
  kAddPositions,
  kAdamW,
  kAdamW16,
  kSumSquares,
  kSumSquares16,
  kScale,
  kScale16,
  kRound16,
  kWiden16,
  kAccumulate16,
  kNonfinite16,
  kCopy,
  kFill,
  kAxpy,
  kCount,
};
inline constexpr int kNumOps = static_cast<int>(Op::kCount);
const char* op_name(Op op);  // "matmul_forward"
// The operations on 16-bit storage (they exist for T = float only).
bool is_16bit_op(Op op);

template <typename T>
class Backend {
 public:
  virtual ~Backend() = default;
  // "cpu (onednn)", "reference": for messages and logs.
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  // Every operation, but the 16-bit ones in f64 (a backend lacking more
  // says so by overriding).
  virtual bool supports(Op op) const;

  // A tracked allocation on this backend's device (kernels and layers write
  // it through this backend only). A backend that queues its operations on
  // a stream frees in stream order (core/event.h).
  virtual Buffer alloc(size_t bytes, MemCategory category, bool zeroed = true) const = 0;
  // Makes the operations this backend runs next see what completes at `e`
  // (a collective's DeviceEvent, Work::event()): a host backend blocks
  // until the device has passed it; a backend with a stream of its own
  // orders the stream after it and returns at once.
  virtual void order_after(const DeviceEvent& e) const { e.synchronize(); }
  // A cache for the GEMMs' own layouts of 16-bit weights (types.h), for
  // the owner of such weights to hand out with them and clear when it
  // writes them; null where the GEMMs have no such layout.
  virtual std::unique_ptr<WeightPacks> make_weight_packs() const { return nullptr; }

  // ---- GEMM ----
  // C (M, N) = alpha op(A) op(B) + beta C; op = transpose when trans_*.
  virtual void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha,
                    const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C,
                    int64_t ldc) const = 0;
  // out (N, OC) = inp (N, C) @ weight (C, OC) + bias (OC); bias may be null.
  // An input with a bf16 twin (types.h) is rounded into it first, and the
  // twin multiplied.
  virtual void matmul_forward(T* out, InputArg<T> inp, WeightArg<T> weight, const T* bias,
                              int64_t N, int64_t C, int64_t OC) const = 0;
  // dinp (N, C) += dout @ weight^T (= with dinp_write kSet); dweight (C, OC)
  // += inp^T @ dout; dbias (OC) += column sums of dout. Any of the three may
  // be null. An input with a bf16 twin is read from the twin.
  virtual void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, InputArg<T> inp,
                               WeightArg<T> weight, int64_t N, int64_t C, int64_t OC,
                               GradWrite dinp_write) const = 0;
  // Whether matmul_forward / matmul_backward take inputs, and
  // matmul_nt_backward an output gradient, with bf16 twins (types.h Input):
  // GEMMs with bf16 inputs that read bf16 operands.
  virtual bool reads_inputs16() const { return false; }
  // Whether the 16-bit forms that read and write a record's bf16 values
  // themselves (attention_forward_16 / attention_backward_16,
  // gelu_forward_record_16 / gelu_backward_16) are fused, so that a record
  // gains by keeping q|k|v and GELU's input as their twins: the defaults
  // round and widen in passes of their own, into a temporary.
  virtual bool fuses_record16() const { return false; }
  // The tied LM head: out (N, V) = inp (N, C) @ weight^T, weight (V, C).
  virtual void matmul_nt_forward(T* out, const T* inp, WeightArg<T> weight, int64_t N, int64_t C,
                                 int64_t V) const = 0;
  // dinp (N, C) += dout (N, V) @ weight; dweight (V, C) += dout^T @ inp; either may be null.
  // dout may come as its bf16 twin alone (r16 written, data null: the
  // cross-entropy's gradient written straight into 16 bits), on backends
  // whose reads_inputs16() is true.
  virtual void matmul_nt_backward(T* dinp, T* dweight, InputArg<T> dout, const T* inp,
                                  WeightArg<T> weight, int64_t N, int64_t C, int64_t V) const = 0;

  // ---- normalisation, activations ----
  // out (N, C) = (inp - mean) * rstd * weight + bias; saves mean (N), rstd (N).
  virtual void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight,
                                 const T* bias, int64_t N, int64_t C) const = 0;
  // dinp (N, C), dweight (C), dbias (C) accumulate; dinp may be null (weight
  // then unread); dweight and dbias are null together.
  virtual void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                                  const T* weight, const T* mean, const T* rstd, int64_t N,
                                  int64_t C) const = 0;
  // out16 (N, C) = layernorm_forward's output rounded to t, bit for bit, and
  // its mean and rstd (f32 alone): a LayerNorm's output written straight
  // into its 16-bit home when only the next linear's GEMMs read it.
  virtual void layernorm_forward_16(uint16_t* out16, float* mean, float* rstd, const float* inp,
                                    const float* weight, const float* bias, int64_t N, int64_t C,
                                    DType t) const;
  // out (n) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  virtual void gelu_forward(T* out, const T* inp, int64_t n) const = 0;
  // out16 (n) = gelu_forward's values rounded to t, bit for bit (f32 alone):
  // the MLP's hidden activation written straight into its 16-bit home when
  // only the next GEMM reads it, never stored in f32.
  virtual void gelu_forward_16(uint16_t* out16, const float* inp, int64_t n, DType t) const;
  // dinp (n) = gelu'(inp) * dout: written over, the layer's scratch (every
  // caller's gradient has this one contribution).
  virtual void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const = 0;
  // gelu_forward's values (into out16 rounded to t when it is not null, as
  // gelu_forward_16, else into out in f32), and inp16 (n) = inp rounded to
  // t, both bit for bit, in one pass (f32 alone): the MLP's GELU input
  // recorded in 16 bits by the kernel that reads it last in forward, never
  // rounded again by packing.
  virtual void gelu_forward_record_16(float* out, uint16_t* out16, const float* inp,
                                      uint16_t* inp16, int64_t n, DType t) const;
  // gelu_backward with inp read from its 16-bit values (inp16), bit for bit
  // gelu_backward of those values widened (f32 alone): never widened into
  // an f32 copy first.
  virtual void gelu_backward_16(float* dinp, const uint16_t* inp16, const float* dout, int64_t n,
                                DType t) const;
  // out (n) = a + b.
  virtual void residual_forward(T* out, const T* a, const T* b, int64_t n) const = 0;
  // dst (n) += src.
  virtual void add(T* dst, const T* src, int64_t n) const = 0;
  // y (N, C) += bias (C) on every row.
  virtual void bias_add(T* y, const T* bias, int64_t N, int64_t C) const = 0;
  // x (n, C) *= the keep masks of rows [row0, row0 + n) of the flattened
  // (B, Tn) grid (a sequence-parallel rank's rows keep their one-process
  // masks). Its backward is the same call on the gradient.
  virtual void dropout(T* x, const DropoutSpec& spec, int64_t Tn, int64_t C, int64_t row0,
                       int64_t n) const = 0;
  // out (n, C) = x * those keep masks + residual, in one pass (residual
  // null: nothing added, a dropout out of place; out may be x). A block's
  // sublayer output dropped and added to the residual stream; its backward
  // is the call on the gradient without a residual (the residual's own
  // gradient being the output's).
  virtual void dropout_residual(T* out, const T* x, const T* residual, const DropoutSpec& spec,
                                int64_t Tn, int64_t C, int64_t row0, int64_t n) const = 0;

  // ---- attention ----
  // Causal self-attention. qkv (B, T, 3C) holds q, k, v side by side, each
  // NH heads x hs = C / NH; out (B, T, C); lse (B, NH, T) = log sum_j
  // exp(q.k_j / sqrt(hs)); dropout on the probabilities.
  virtual void attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t C,
                                 int64_t NH, const DropoutSpec& dropout) const = 0;
  // dqkv (B, T, 3C) from dout (B, T, C), given forward's inputs and outputs,
  // written over what the buffer held (every element of it).
  virtual void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse,
                                  int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                  const DropoutSpec& dropout) const = 0;
  // attention_forward, and q|k|v rounded to bf16 into qkv16 (laid out as
  // qkv; round_16's values bit for bit): the record's bf16 home of q|k|v,
  // which only the attention core reads (a twin), filled by the core
  // instead of by packing. f32 alone.
  virtual void attention_forward_16(float* out, float* lse, const float* qkv, uint16_t* qkv16,
                                    int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                    const DropoutSpec& dropout) const;
  // attention_backward from q|k|v's bf16 values alone (qkv16), bit for bit
  // attention_backward of those values widened. f32 alone.
  virtual void attention_backward_16(float* dqkv, const float* dout, const uint16_t* qkv16,
                                     const float* out, const float* lse, int64_t B, int64_t Tn,
                                     int64_t C, int64_t NH, const DropoutSpec& dropout) const;
  // Causal attention of one chunk of queries against one chunk of keys and
  // values of a longer sequence (context parallelism; AttentionChunk holds
  // the shapes, strides and global positions), merged by the log-sum-exp
  // into out and lse: on entry they hold the attention over the keys seen
  // so far (lse -inf where none), on return over these keys too. Dropout on
  // the probabilities as attention_forward draws it at the same global
  // (query, key) positions.
  virtual void attention_chunk_forward(T* out, T* lse, const T* q, const T* kv,
                                       const AttentionChunk& a,
                                       const DropoutSpec& dropout) const = 0;
  // dq (q's layout) and dkv (kv's layout) += this chunk pair's share of the
  // gradient, given the final out and lse over every key.
  virtual void attention_chunk_backward(T* dq, T* dkv, const T* dout, const T* q, const T* kv,
                                        const T* out, const T* lse, const AttentionChunk& a,
                                        const DropoutSpec& dropout) const = 0;

  // ---- losses ----
  // logits (N, Vp), the first V columns real: losses (N) = lse_n -
  // logits[n, targets[n]]; lse (N) saved.
  virtual void cross_entropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets,
                                     int64_t N, int64_t V, int64_t Vp) const = 0;
  // In place, over a vocabulary range [v0, v0 + Vp) of which the first V
  // columns are real: logits[n, v] := dloss[n] * (exp(logits[n, v] -
  // lse[n]) - [v0 + v == targets[n]]); padded columns 0. One process: v0 = 0.
  virtual void cross_entropy_backward(T* logits, const T* lse, const int32_t* targets,
                                      const T* dloss, int64_t N, int64_t V, int64_t Vp,
                                      int64_t v0) const = 0;
  // dlogits16 (N, Vp) = cross_entropy_backward's values rounded to t, bit for
  // bit (f32 alone), logits left as they are: the LM head's output gradient
  // written straight into the 16 bits its GEMMs read, never stored in f32.
  virtual void cross_entropy_backward_16(uint16_t* dlogits16, const float* logits, const float* lse,
                                         const int32_t* targets, const float* dloss, int64_t N,
                                         int64_t V, int64_t Vp, int64_t v0, DType t) const;
  // A vocabulary-parallel rank's part of the loss, logits (N, Vp) over
  // columns [v0, v0 + Vp), the first V real: mx (N) = the row maxima of the
  // real columns (-inf when none), target (N) = logits[n, targets[n] - v0]
  // where that column is this rank's, else 0.
  virtual void vocab_logit_stats(T* mx, T* target, const T* logits, const int32_t* targets,
                                 int64_t N, int64_t V, int64_t Vp, int64_t v0) const = 0;
  // sum (N) = sum over the real columns of exp(logits - mx) (added in double).
  virtual void vocab_sum_exp(T* sum, const T* logits, const T* mx, int64_t N, int64_t V,
                             int64_t Vp) const = 0;

  // ---- embeddings ----
  // out (B, T, C) = wte[tokens[b, t]] + wpe[pos[t]]; tokens (B, T), wte (V, C), wpe (maxT, C);
  // pos (T) the global position of each local one (context parallelism), null: t.
  virtual void encoder_forward(T* out, const int32_t* tokens, WeightArg<T> wte, WeightArg<T> wpe,
                               int64_t B, int64_t Tn, int64_t C, const int32_t* pos) const = 0;
  // dwte[tokens - v0] += dout for the tokens in [v0, v1) (dwte holds those
  // rows; one process: [0, V)), dwpe[pos[t]] += dout[b, t]; each row's
  // contributions summed apart first and added once.
  virtual void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B,
                                int64_t Tn, int64_t C, int64_t v0, int64_t v1,
                                const int32_t* pos) const = 0;
  // out (N, C) = wte[tokens[n] - v0] for tokens in [v0, v1), else 0 (a
  // vocabulary-parallel lookup; wte holds rows [v0, v1)).
  virtual void embedding_lookup(T* out, const int32_t* tokens, WeightArg<T> wte, int64_t N,
                                int64_t C, int64_t v0, int64_t v1) const = 0;
  // out (n, C) += wpe[pos[(row0 + i) % Tn]] for the rows [row0, row0 + n) of the (B, Tn) grid
  // (pos null: the position itself).
  virtual void add_positions(T* out, WeightArg<T> wpe, int64_t Tn, int64_t C, int64_t row0,
                             int64_t n, const int32_t* pos) const = 0;

  // ---- optimizer ----
  // m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  // p -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd p). n elements.
  virtual void adamw(T* params, const T* grads, T* m, T* v, int64_t n,
                     const AdamWParams& hp) const = 0;
  // adamw on f32 masters with 16-bit gradients (type t) widened and scaled
  // by grad_scale; params (t) = the updated masters rounded.
  virtual void adamw_16(float* master, const uint16_t* grads, float grad_scale, float* m, float* v,
                        uint16_t* params, int64_t n, DType t, const AdamWParams& hp) const;

  // ---- reductions, scaling, precision ----
  // The sum of squares of x (n), accumulated in double over fixed chunks
  // (the same chunks for sum_squares_16, so both agree bit for bit).
  virtual double sum_squares(const T* x, int64_t n) const = 0;
  virtual double sum_squares_16(const uint16_t* x, int64_t n, DType t) const;
  // x (n) *= s.
  virtual void scale(T* x, int64_t n, T s) const = 0;
  virtual void scale_16(uint16_t* x, int64_t n, float s, DType t) const;
  // out (n) = x rounded to t (kBF16 or kF16): nearest, ties to even.
  virtual void round_16(const float* x, uint16_t* out, int64_t n, DType t) const;
  // out (n) = x (t) as f32 (exact).
  virtual void widen_16(const uint16_t* x, float* out, int64_t n, DType t) const;
  // acc (n, t) = acc + x * scale, added in f32 and rounded once; x in f32
  // (x16 null) or in t (x null).
  virtual void accumulate_16(const float* x, const uint16_t* x16, float scale, uint16_t* acc,
                             int64_t n, DType t) const;
  // Whether any element of x (n, t) is infinite or NaN.
  virtual bool nonfinite_16(const uint16_t* x, int64_t n, DType t) const;

  // ---- memory ----
  // dst (n) = src (n); the ranges may not overlap.
  virtual void copy(T* dst, const T* src, int64_t n) const = 0;
  // x (n) = value.
  virtual void fill(T* x, int64_t n, T value) const = 0;
  // y (n) += a * x.
  virtual void axpy(T* y, T a, const T* x, int64_t n) const = 0;

 protected:
  // Throws Error(kUnsupported): "backend <name> does not support <op>".
  [[noreturn]] void unsupported(Op op) const;
};

extern template class Backend<float>;
extern template class Backend<double>;

// The backend a store or stage gets when its maker names none: the CPU
// backend with OpenBLAS GEMMs and f32 inputs, shared and immutable.
template <typename T>
const Backend<T>& default_backend();

}  // namespace loom
