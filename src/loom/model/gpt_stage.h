// A GPT stage: the part of GPT-2 one pipeline rank holds. Optional token and
// position embedding, transformer blocks [first, last) (global indices), and,
// on the last stage, the head (final norm, LM head tied to wte, loss). One
// stage holding every block is the whole model. A last stage that is not the
// first keeps its own copy of transformer.wte.weight for the tied head.
//
// Parameters live in the stage's ParamStore, unit by unit (embeddings, one
// unit per block, ln_f, and the head's wte copy where there is one). What a
// micro-batch keeps between forward and backward lives in a StageActivations
// the caller owns, so several micro-batches can be in flight; backward's
// scratch and the room that recomputation writes into belong to the stage.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/core/memory.h"
#include "loom/model/recompute.h"
#include "loom/nn/block.h"
#include "loom/nn/deferred_grads.h"
#include "loom/nn/factory.h"
#include "loom/nn/param_store.h"

namespace loom {

struct StageSpec {
  int first = 0;
  int last = -1;  // one past the last block; -1: n_layer
};

// One micro-batch of (B, T) in flight through a stage.
template <typename T>
struct StageActivations {
  int64_t B = 0, Tn = 0;
  uint64_t plan_id = 0;  // the stage's recompute plan it was laid out for
  Buffer buffer;         // the whole record, under MemCategory::kActivations
  StepContext ctx;
  const int32_t* tokens = nullptr;   // (B,T), owned by the caller (first stage)
  const int32_t* targets = nullptr;  // (B,T) or null (last stage)
  T* input = nullptr;                // (rows,C): the first block's input (this rank's rows)
  std::vector<T*> blocks;            // each block's record
  T* head = nullptr;                 // the head's record
  T* output = nullptr;               // (rows,C): the last block's output
  // (B,T,V) over this rank's vocabulary (all of the padded vocabulary
  // without tensor parallelism) after forward, on the last stage. When the plan recomputes the
  // logits they live in the stage's shared room: valid until its next
  // forward or backward.
  T* logits = nullptr;
};

// Keys and values of every layer for one sequence being decoded, plus the
// one-row scratch a decoding step needs.
template <typename T>
struct KvCache {
  int64_t len = 0;      // positions filled
  std::vector<T> k, v;  // per layer (seq_len, C)
  std::vector<T> x, ln, stat, qkv, att, ffn, out, scores, logits;
  std::vector<int32_t> tokens;  // decoded so far (fixed MoE routers read them)
};

template <typename T>
class GptStage {
 public:
  // The layers come from `layers` (the single-process ones by default;
  // parallel/tensor's factory splits them across a tensor-parallel group);
  // they compute on `backend`, which holds the parameters, gradients and
  // activations (it must outlive the stage).
  GptStage(const GptConfig& config, StageSpec spec = {}, StoreOptions storage = {},
           const LayerFactory<T>& layers = LayerFactory<T>::single_process(),
           const Backend<T>& backend = default_backend<T>());
  const Backend<T>& backend() const { return store_.backend(); }

  const GptConfig& config() const { return config_; }
  int first() const { return first_; }
  int last() const { return last_; }
  bool has_embedding() const { return embedding_ != nullptr; }
  bool has_head() const { return head_ != nullptr; }

  ParamStore<T>& store() { return store_; }
  const ParamStore<T>& store() const { return store_; }
  const ParamLayout& layout() const { return store_.layout(); }
  int64_t num_params() const { return store_.num_params(); }
  T* params() const { return store_.params(); }
  T* grads() const { return store_.grads(); }
  T* param(const Param& p) const { return store_.param(p); }
  T* grad(const Param& p) const { return store_.grad(p); }
  void init(uint64_t seed) { store_.init(seed); }
  void zero_grads() { store_.zero_grads(); }

  // Activation checkpointing: the plan for (B, T) micro-batches under
  // `policy` with `in_flight` micro-batches held at once (the budget covers
  // them all, and the stage's shared room); set_plan applies one. Stores
  // made before set_plan must not be used after it.
  RecomputePlan plan(const CheckpointPolicy& policy, int64_t B, int64_t Tn,
                     int in_flight = 1) const;
  void set_plan(RecomputePlan plan);
  const RecomputePlan& recompute_plan() const { return plan_; }
  // Activation bytes under the current plan: one micro-batch's store, and the
  // stage's shared room (recomputed blocks, logits, selective parts).
  size_t store_bytes(int64_t B, int64_t Tn) const { return store_bytes(B, Tn, plan_); }
  size_t room_bytes(int64_t B, int64_t Tn) const { return room_bytes(B, Tn, plan_); }
  size_t store_bytes(int64_t B, int64_t Tn, const RecomputePlan& plan) const;
  size_t room_bytes(int64_t B, int64_t Tn, const RecomputePlan& plan) const;
  // The per-block record sizes the budget policy works from (`records`:
  // what a kNone or kSelective record is kept in).
  size_t block_bytes(int64_t B, int64_t Tn, Recompute mode, DType records = DType::kF32) const;
  // The ranges of block i's record kept as bf16 twins under the current
  // plan (RecordTwins; none where the block does not use them).
  std::vector<RecordRange> record_twin_ranges(size_t i, int64_t B, int64_t Tn) const {
    return uses_twins(i) ? twin_ranges(i, rows(B, Tn)) : std::vector<RecordRange>{};
  }

  // This rank's rows of a micro-batch of (B, T) (a slice when the layers
  // split the sequence).
  Rows rows(int64_t B, int64_t Tn) const;

  // Units in the order forward (and then backward) uses them: derived from
  // forward_steps / backward_steps, the lists forward and backward run.
  std::vector<UnitUse> unit_schedule(bool backward) const;
  // Those of backward alone (a pipeline runs it apart from its forward);
  // `deferred`: of a backward whose parameter gradients are deferred.
  std::vector<UnitUse> backward_unit_schedule(bool deferred = false) const;
  // Those of apply_deferred(d).
  std::vector<UnitUse> deferred_unit_schedule(const DeferredGrads<T>& d) const;
  // The unit holding transformer.wte.weight (the embeddings on the first
  // stage, the head's copy on a last stage that is not first); -1: none.
  int wte_unit() const { return embedding_ ? emb_unit_ : wte_unit_; }
  // Whether this stage holds a copy of wte that another stage owns (its
  // gradient is summed with the owner's; norms and checkpoints count the owner's).
  bool wte_is_copy() const { return head_ && !embedding_; }

  // A store for micro-batches of (B, T), T <= seq_len, under the current plan.
  StageActivations<T> make_activations(int64_t B, int64_t Tn) const;

  // The first stage reads `tokens` (B,T); another reads `input` (B,T,C), the
  // previous stage's output. The last stage returns the mean loss over B*T
  // tokens when targets are given (else 0; logits in a.logits); another
  // leaves its output in a.output.
  double forward(StageActivations<T>& a, const int32_t* tokens, const T* input,
                 const int32_t* targets, const StepContext& ctx);
  // Accumulates into the gradients the gradient of loss_scale * mean loss.
  // A stage without the head takes d_output (B,T,C), the gradient of its
  // output; a stage without the embedding writes d_input (B,T,C). With
  // `defer` (zero-bubble's B) only d_input is computed; the parameter
  // gradients are recorded there for apply_deferred (its W), and the store
  // `a` may be reused at once.
  void backward(StageActivations<T>& a, double loss_scale, const T* d_output = nullptr,
                T* d_input = nullptr, DeferredGrads<T>* defer = nullptr);
  // Accumulates the recorded parameter gradients, unit by unit, and clears d.
  void apply_deferred(DeferredGrads<T>& d);
  // Seconds spent recomputing forwards in backward since the last call.
  double take_recompute_seconds();
  // Seconds each piece of the stage computed since the last call, by pass:
  // the embeddings, each block ("h.3"), "ln_f" and "lm_head" (the logits
  // and the loss), in forward order. Its unit's hooks (a ZeRO-3 gather, a
  // reduction) are not counted; a block's 16-bit record packing is; a
  // deferred parameter-gradient pass (zero-bubble's W) counts as backward
  // of its unit's piece (a tied wte's as the embeddings').
  // params: the elements of its units this rank holds (its tensor-parallel
  // slice, a block's experts included, alignment padding included; 0 for a
  // tied lm_head).
  struct PieceSeconds {
    std::string name;
    int64_t params = 0;
    double forward = 0, backward = 0, recompute = 0;
    // With record_spans: when it ran, [start, end) in steady_clock seconds
    // (comm_clock's axis), one span per pass with its unit's hooks, so
    // that the collectives a piece issued can be told from the record.
    std::vector<std::pair<double, double>> spans = {};
  };
  std::vector<PieceSeconds> take_piece_seconds();
  // Whether passes also record their spans (log.profile; off, nothing
  // accumulates between takes).
  void record_spans(bool on) { record_spans_ = on; }
  // What each piece keeps from forward to backward for one (B, T)
  // micro-batch under the current plan, in bytes, in take_piece_seconds's
  // order (the embeddings their output; a block its record, packed or not;
  // lm_head the head's record, ln_f's included): they add up to
  // store_bytes(B, T).
  std::vector<size_t> piece_record_bytes(int64_t B, int64_t Tn) const;

  // Incremental decoding (a stage with the embedding and the head): feeds
  // `token` at position cache.len (< seq_len) and returns the logits
  // (padded_vocab) for the next position.
  KvCache<T> make_kv_cache() const;
  const T* decode_step(KvCache<T>& cache, int32_t token);

  // The whole model's parameter count (whatever this stage holds).
  double model_params() const;
  // Blocks whose feed-forward slot is a mixture of experts (whole model).
  int moe_layers() const;
  // The parameters one token uses: a mixture of experts' k experts of E.
  double active_params() const;
  // This stage's MoE layers' load statistics since the last call, by the
  // block's global index.
  std::vector<std::pair<int, MoeStats>> take_moe_stats();
  // Model FLOPs per token for training (6 x the parameters a token uses +
  // 12 x layers x T x C) of the whole model, the numerator of MFU; a
  // mixture of experts counts the k experts a token runs; never counts
  // recomputation.
  double flops_per_token() const;

 private:
  // One use of a unit: what runs (the token and position lookup, block
  // `block`, the final norm, the tied LM head, a block's recomputation) and
  // under which pass. forward() and backward() walk these lists, and the
  // unit schedules the hooks see are read off them, so the order is
  // declared once. hooks: the use is announced to the store's hooks (a
  // deferred lookup backward only records, and announces nothing).
  struct UnitStep {
    enum Kind { kEmbedding, kBlock, kNorm, kLogits, kRecompute } kind;
    int unit = -1;
    size_t block = 0;
    Pass pass = Pass::kForward;
    bool hooks = true;
  };
  std::vector<UnitStep> forward_steps() const;
  std::vector<UnitStep> backward_steps(bool deferred) const;
  static std::vector<UnitUse> uses(const std::vector<UnitStep>& steps);
  Recompute mode(size_t i) const { return plan_.blocks[i]; }
  // Whether block i's record is packed into 16 bits under `p`.
  static bool packed(const RecomputePlan& p, size_t i) {
    return p.records != DType::kF32 && p.blocks[i] != Recompute::kFull;
  }
  // Whether block i's layers read bf16 twins in its packed record
  // (RecordTwins): bf16 records on a backend whose GEMMs read bf16 inputs
  // (the linears' twins and the kernels') or that fuses the kernels' 16-bit
  // record forms (theirs alone).
  bool uses_twins(size_t i) const {
    const Backend<T>& be = store_.backend();
    return packed(plan_, i) && plan_.records == DType::kBF16 &&
           (be.reads_inputs16() || be.fuses_record16());
  }
  // Block i's twins: with the linears' too where the GEMMs read bf16.
  std::vector<RecordRange> twin_ranges(size_t i, const Rows& rows, bool shared = true) const {
    return blocks_[i].layer->twin_ranges(rows, mode(i), store_.backend().reads_inputs16(), shared);
  }
  // Block i's twins over the room (where the record is computed or widened)
  // and its slot in `a`.
  RecordTwins record_twins(const StageActivations<T>& a, size_t i, const T* room) const;
  // Block i's record in a micro-batch's store under `p`, in elements.
  int64_t slot_elems(size_t i, const Rows& rows, const RecomputePlan& p) const;
  void ensure_work(int64_t B, int64_t Tn);
  void check_store(const StageActivations<T>& a) const;
  // Block i's forward into its record as the plan lays it out.
  void block_forward(StageActivations<T>& a, size_t i, const Dropout& drop);
  // Block i (recomputed in full) run forward again into the room.
  void block_recompute(StageActivations<T>& a, size_t i, const Dropout& drop);
  // Backward through block i, its record where the plan keeps it.
  void block_backward(StageActivations<T>& a, size_t i, T* d_resid, T* scratch,
                      const Dropout& drop);
  T* block_input(const StageActivations<T>& a, size_t i) const {
    return i == 0 ? a.input : a.blocks[i - 1] + block_output_offset(a, i - 1);
  }
  int64_t block_output_offset(const StageActivations<T>& a, size_t i) const;
  HeadRecord<T> head_record(const StageActivations<T>& a, T* room) const;

  GptConfig config_;
  int first_ = 0, last_ = 0;
  ParamStore<T> store_;
  std::unique_ptr<EmbeddingLayer<T>> embedding_;
  struct StageBlock {
    std::unique_ptr<Block<T>> layer;
    int unit;  // its unit in the store
  };
  std::vector<StageBlock> blocks_;
  std::unique_ptr<HeadLayer<T>> head_;
  bool serial_layers_ = true;
  std::pair<int, int> split_{0, 1};  // the layers' sequence split (piece, pieces)
  // Context parallelism: the global position of each of the seq_len / cp
  // local ones (empty: whole sequences).
  std::vector<int32_t> positions_;
  int emb_unit_ = -1, lnf_unit_ = -1, wte_unit_ = -1;
  // take_piece_seconds's pieces, and per unit its piece.
  std::vector<PieceSeconds> pieces_;
  std::vector<int> unit_piece_;
  size_t piece_of(const UnitStep& st) const;
  void add_seconds(size_t piece, Pass pass, double s);
  // With record_spans: the piece ran from `from` to now (its unit's hooks,
  // which start ZeRO gathers and gradient reductions, included).
  void add_span(size_t piece, std::chrono::steady_clock::time_point from);
  bool record_spans_ = false;
  RecomputePlan plan_;
  uint64_t plan_id_ = 1;
  // Backward's gradient scratch (workspace) and the shared recompute room
  // (activations), sized for the largest micro-batch seen.
  int64_t work_bt_ = 0;
  Buffer scratch_, room_;
  double recompute_s_ = 0;
};

extern template class GptStage<float>;
extern template class GptStage<double>;

}  // namespace loom
