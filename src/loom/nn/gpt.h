// GPT-2: learned position embeddings, pre-LayerNorm blocks (causal attention,
// 4x MLP with GELU), final LayerNorm, LM head tied to the token embedding.
// Each layer is an explicit forward/backward pair over raw buffers; what a
// micro-batch keeps for backward lives in its own GptActivations.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "loom/core/memory.h"
#include "loom/core/rng.h"
#include "loom/nn/param.h"

namespace loom {

struct GptConfig {
  int n_layer = 2;
  int n_embd = 64;
  int n_head = 4;
  int vocab_size = 256;
  int seq_len = 64;
  float dropout = 0.0f;
  // vocab_size rounded up to a multiple of 128; the extra logits are padding.
  int padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
};

// Per-step inputs that make dropout reproducible under any layout.
struct StepContext {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t sample0 = 0;  // global index of the micro-batch's first sample
  bool training = true;  // dropout only when training
};

// Everything one micro-batch of (B, T) keeps between forward and backward.
template <typename T>
struct GptActivations {
  struct Layer {
    T *ln1, *ln1_mean, *ln1_rstd;  // (B,T,C) (B,T) (B,T)
    T *qkv, *atty, *att_lse;       // (B,T,3C) (B,T,C) (B,NH,T)
    T* res2;                       // (B,T,C) residual after attention
    T *ln2, *ln2_mean, *ln2_rstd;  // (B,T,C) (B,T) (B,T)
    T *fch, *fch_gelu;             // (B,T,4C) each
    T* res3;                       // (B,T,C) block output
  };
  int64_t B = 0, Tn = 0;
  Buffer buffer;
  const int32_t* tokens = nullptr;   // (B,T), owned by the caller
  const int32_t* targets = nullptr;  // (B,T) or null
  T* encoded = nullptr;              // (B,T,C)
  std::vector<Layer> layers;
  T *lnf, *lnf_mean, *lnf_rstd;  // (B,T,C) (B,T) (B,T)
  T* logits;                     // (B,T,Vp); gradient after backward
  T *losses, *ce_lse;            // (B,T) each
  StepContext ctx;
};

// Keys and values of every layer for one sequence being decoded, plus the
// one-row scratch a decoding step needs.
template <typename T>
struct KvCache {
  int64_t len = 0;      // positions filled
  std::vector<T> k, v;  // per layer (seq_len, C)
  std::vector<T> x, ln, stat, qkv, att, fch, fch_gelu, out, scores, logits;
};

// Which pass uses a unit: forward and backward read its parameters; the
// backward of the token and position lookup only writes gradients.
enum class Pass { kForward, kBackward, kBackwardGradsOnly };
inline bool reads_params(Pass p) {
  return p != Pass::kBackwardGradsOnly;
}

struct UnitUse {
  int unit;
  Pass pass;
};

// Called around every use of a unit (ZeRO stage 3 gathers its parameters
// before a use that reads them and releases them after) and, in backward, of
// its gradients (ZeRO reduces them after the last use that writes them). A unit may be used more
// than once in a pass: the embeddings open the forward and (tied LM head) close it; backward starts
// and ends with them. unit_schedule() lists the uses in order.
struct GptHooks {
  std::function<void(int unit, Pass pass)> before, after;
};

// Where the model's parameters and gradients live. By default the model owns
// full flat buffers; under ZeRO a data-parallel engine owns shards and binds
// each unit's storage before the model uses it.
struct GptStorage {
  int64_t unit_multiple = 1;  // every unit padded to a multiple of this
  bool params = true;         // allocate the full parameter buffer
  bool grads = true;          // allocate the full gradient buffer
};

template <typename T>
class Gpt {
 public:
  explicit Gpt(const GptConfig& config, GptStorage storage = {});

  const GptConfig& config() const { return config_; }
  const ParamLayout& layout() const { return layout_; }
  // Elements of the flat buffers (parameters plus alignment and unit padding).
  int64_t num_params() const { return layout_.total(); }
  // The full flat buffers; null when not allocated (see GptStorage).
  T* params() const { return params_.template as<T>(); }
  T* grads() const { return grads_.template as<T>(); }
  T* param(const Param& p) const { return unit_params_[p.unit] + (p.offset - unit_begin_[p.unit]); }
  T* grad(const Param& p) const { return unit_grads_[p.unit] + (p.offset - unit_begin_[p.unit]); }

  // Points unit u's parameters (gradients) at `base`, which holds the unit's
  // elements [begin, end) of the flat layout; null unbinds.
  void bind_params(int u, T* base) { unit_params_[u] = base; }
  void bind_grads(int u, T* base) { unit_grads_[u] = base; }
  // Allocates the full parameter buffer if it is not, and binds every unit
  // to it; release_params() frees it again (both for ZeRO stage 3).
  void allocate_params();
  void release_params();
  void set_hooks(GptHooks hooks) { hooks_ = std::move(hooks); }
  // Units in the order forward (and then backward) uses them.
  std::vector<UnitUse> unit_schedule(bool backward) const;
  int unit_of_layer(int l) const { return l + 1; }

  // Initialises every parameter from (seed, name, global element index).
  void init(uint64_t seed);
  // Writes elements [begin, end) of the initialised flat buffer into dst
  // (padding zero): a ZeRO shard initialises only what it holds.
  void init_range(uint64_t seed, int64_t begin, int64_t end, T* dst) const;
  void zero_grads();

  // Activation store for micro-batches of (B, T), T <= seq_len.
  GptActivations<T> make_activations(int64_t B, int64_t Tn) const;

  // Runs the forward pass; returns the mean loss over B*T tokens when
  // targets are given (else 0 and only logits are valid).
  double forward(GptActivations<T>& a, const int32_t* tokens, const int32_t* targets,
                 const StepContext& ctx);
  // Accumulates into the gradients the gradient of loss_scale * mean loss.
  void backward(GptActivations<T>& a, double loss_scale);

  // Incremental decoding: feeds `token` at position cache.len (< seq_len)
  // and returns the logits (padded_vocab) for the next position. Equal to the
  // full forward's logits at that position, without recomputing the prefix.
  KvCache<T> make_kv_cache() const;
  const T* decode_step(KvCache<T>& cache, int32_t token);

  // Model FLOPs per token for training (6 x params + 12 x layers x T x C),
  // the numerator of MFU; never counts recomputation.
  double flops_per_token() const;

 private:
  struct LayerParams {
    const Param *ln1_w, *ln1_b, *attn_w, *attn_b, *proj_w, *proj_b;
    const Param *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
  };
  void block_forward(int l, GptActivations<T>& a, const T* x);
  // dresid (B,T,C): gradient of the block output in, of its input out.
  void block_backward(int l, GptActivations<T>& a, const T* x, T* dresid);
  void ensure_scratch(int64_t BT);
  void before(int u, Pass pass) {
    if (hooks_.before) hooks_.before(u, pass);
  }
  void after(int u, Pass pass) {
    if (hooks_.after) hooks_.after(u, pass);
  }

  GptConfig config_;
  ParamLayout layout_;
  Buffer params_, grads_;
  std::vector<int64_t> unit_begin_;
  std::vector<T*> unit_params_, unit_grads_;
  GptHooks hooks_;
  const Param *wte_, *wpe_, *lnf_w_, *lnf_b_;
  std::vector<LayerParams> lp_;
  // Gradient scratch shared by all layers, sized for the largest micro-batch.
  int64_t scratch_bt_ = 0;
  Buffer scratch_;
  T *d_resid_, *d_ln_, *d_proj_, *d_atty_, *d_qkv_, *d_fch_, *d_fch_gelu_;
};

extern template class Gpt<float>;
extern template class Gpt<double>;

}  // namespace loom
