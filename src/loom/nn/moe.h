// A mixture-of-experts layer in a block's feed-forward slot: the router
// (nn/router.h) picks top-k of E experts for each token, each expert (a GPT
// MLP) runs once over the rows dispatched to it, and the outputs combine
// weighted by the gates. Parameters, under Hugging Face-style names:
//   <prefix>.router.weight          (C, E), the learned router's
//                                   (hash and tag routers have none)
//   <prefix>.experts.<e>.c_fc.*     as Mlp's, per expert (e: its global index)
//   <prefix>.experts.<e>.c_proj.*
// The experts go into an expert unit riding on the block's (Unit::host).
// Without a dispatcher every expert is here; with one (expert parallelism)
// this rank holds experts [first, first + E / ranks) and the rows of each
// assignment (Dispatch order) travel to the rank holding their expert and
// back, forward and backward.
//
// The balancing losses enter backward only (they shape the router, not the
// reported loss): their gradients are weighted by aux_loss_coef and
// z_loss_coef times loss_weight, the factor the main loss's gradient
// carries for this micro-batch (set_loss_weight), so they average over the
// global batch as the main loss does. Load statistics accumulate over a
// step's forwards (take_stats).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/nn/mlp.h"
#include "loom/nn/router.h"

namespace loom {

struct MoeConfig {
  RouterConfig router;
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0;
  // Auxiliary-loss-free balancing: a per-expert bias (<prefix>.router.bias,
  // a parameter no gradient reaches, so checkpoints and ZeRO carry it) added
  // to the probabilities for choosing experts, moved after every step by
  // bias_update_rate towards an equal load (StepEngine).
  bool bias_balancing = false;
  double bias_update_rate = 1e-3;
};

// The plan of one dispatch: which rows each rank of the expert-parallel
// group sends to this rank's experts.
struct ExpertPlan {
  int ranks = 1, local = 0;     // group size, experts per rank
  std::vector<int64_t> counts;  // (ranks, ranks x local): rank s's rows for global expert e
  std::vector<int64_t>
      offsets;  // (local + 1): local expert e's rows here, [offsets[e], offsets[e + 1])
  int64_t rows() const { return offsets.back(); }
};

// Moves the rows of a MoE layer's assignments between the ranks that route
// tokens and the ranks that hold the experts (parallel/expert). Every rank
// of the group calls plan, dispatch and combine in the same order.
template <typename T>
class ExpertDispatcher {
 public:
  virtual ~ExpertDispatcher() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  // From this rank's rows per global expert (`experts` of them, in
  // dispatch order: expert by expert), every rank's (collective).
  virtual ExpertPlan plan(const std::vector<int64_t>& rows_per_expert, int experts) = 0;
  // rows (this rank's n, C), in dispatch order, to the experts' ranks:
  // expert_rows (p.rows(), C), local expert by local expert, within one by
  // sending rank, each rank's in its dispatch order.
  virtual void dispatch(const ExpertPlan& p, const T* rows, int64_t C, T* expert_rows) = 0;
  // The way back: expert_rows (p.rows(), C) to the rows' own ranks, into
  // rows (n, C) in dispatch order.
  virtual void combine(const ExpertPlan& p, const T* expert_rows, int64_t C, T* rows) = 0;
};

// Tensor parallelism's token split (parallel/tensor): the ranks of a
// tensor-parallel group hold the same input rows and the same router and
// experts; each routes and runs the experts for an equal part of the
// micro-batch's sequences, and the outputs (and input gradients) are
// gathered. The router's and experts' gradients then hold each rank's
// tokens only: the caller sums them over the group once per step.
template <typename T>
class RowSplit {
 public:
  virtual ~RowSplit() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  // all (ranks x n) = every rank's mine (n), in rank order (collective).
  virtual void gather(const T* mine, int64_t n, T* all) = 0;
};

// Context parallelism's token split (parallel/context): each rank of the
// context-parallel group holds two chunks of every sequence (ContextSplit).
// A routing group is a whole sequence, so the routers' inputs (logits, or
// token ids) are gathered over the group, every rank routes the whole
// sequences alike, and each keeps its own tokens' part.
template <typename T>
class SequenceGather {
 public:
  virtual ~SequenceGather() = default;
  virtual ContextSplit split() const = 0;
  // all (ranks x n) = every rank's mine (n), in rank order (collective).
  virtual void gather(const T* mine, int64_t n, T* all) = 0;
  virtual void gather_ids(const int32_t* mine, int64_t n, int32_t* all) = 0;
};

struct MoeStats {
  std::vector<int64_t> load;  // per expert: assignments chosen, before dropping
  int64_t assignments = 0, dropped = 0;
  double aux = 0, z = 0;  // summed over the forwards
  int64_t forwards = 0;
};

template <typename T>
class MoeLayer final : public FeedForward<T> {
 public:
  // dispatcher: null keeps every expert here.
  MoeLayer(ParamLayout& layout, const std::string& prefix, int64_t C, float proj_std,
           const MoeConfig& config, std::shared_ptr<ExpertDispatcher<T>> dispatcher = nullptr);
  // Splits the sequences of each micro-batch over `split`'s ranks (they
  // must divide evenly).
  void set_row_split(std::shared_ptr<RowSplit<T>> split) { split_ = std::move(split); }
  // Routes whole sequences split over a context-parallel group.
  void set_sequence_gather(std::shared_ptr<SequenceGather<T>> g) { context_ = std::move(g); }
  ParamId router_w, router_b;  // router_b: with bias balancing
  const MoeConfig& config() const { return config_; }
  // Local expert e (global index first_expert() + e).
  const Mlp<T>& expert(int e) const { return *experts_[static_cast<size_t>(e)]; }
  int first_expert() const { return first_; }
  int local_experts() const { return static_cast<int>(experts_.size()); }

  // Record: the router's logits (rows, E), then per assignment (at most
  // rows x k) its row of x and the expert's output; with a dispatcher also
  // the rows the experts here receive (at most expert_rows()); then the
  // experts' MLP records over the rows they ran.
  int64_t record_elems(const Rows& rows, bool selective) const override;
  int64_t recompute_elems(const Rows& rows, bool selective) const override;
  // The router's logits: backward routes again from them, so they stay
  // f32 (a rounded logit could pick another expert).
  std::vector<RecordRange> exact_ranges(const Rows& rows, bool) const override {
    return {{0, logit_elems(local_rows(rows))}};
  }
  int64_t scratch_elems(const Rows& rows) const override;
  void forward(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
               const Rows& rows, T* recompute) const override;
  void backward(const ParamStore<T>& ps, T* record, bool selective, T* dx, const T* dout,
                const T* x, const Rows& rows, T* scratch, T* recompute) const override;

  void set_loss_weight(double w) { loss_weight_ = w; }
  // The token ids of the rows to come (B x T of the micro-batch, in
  // order; `history` more before them readable), which hash and tag
  // routers route by. The caller keeps them until backward.
  void set_tokens(const int32_t* ids, int64_t history = 0) { ids_ = ids, history_ = history; }
  bool learned() const { return config_.router.kind == RouterKind::kLearned; }
  MoeStats take_stats() const;

 private:
  // A routing group is one sequence: rows.Tn tokens.
  // The learned router's from its logits, or a fixed router's from the ids
  // (those of rows `row0` on of the micro-batch).
  Routing<T> routing(const T* logits, const Rows& rows, const T* bias, int64_t row0) const;
  // Context parallelism: the routing of the whole sequences the rows are
  // part of (every rank's logits or ids gathered), and this rank's part of
  // it; own_index[i] is local token i's index in the whole.
  Routing<T> whole_routing(const T* logits, const Rows& rows, const T* bias, int64_t row0) const;
  Routing<T> own_part(const Routing<T>& whole, const Rows& rows) const;
  std::vector<int64_t> own_index(const Rows& rows) const;
  // The tokens of a routing group: a whole sequence.
  int64_t group_tokens(const Rows& rows) const {
    return context_ ? rows.Tn * context_->split().size : rows.Tn;
  }
  // The rows this rank routes: with a row split, its part of the sequences
  // (from row `*row0` of the micro-batch), else all of them.
  Rows local_rows(const Rows& rows, int64_t* row0 = nullptr) const;
  void forward_rows(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
                    const Rows& rows, T* recompute, int64_t row0) const;
  void backward_rows(const ParamStore<T>& ps, T* record, bool selective, T* dx, const T* dout,
                     const T* x, const Rows& rows, T* scratch, T* recompute, int64_t row0,
                     double share) const;
  int64_t logit_elems(const Rows& rows) const {
    return learned() ? rows.count * config_.router.num_experts : 0;
  }
  int64_t slots(const Rows& rows) const { return rows.count * config_.router.top_k; }
  // The most rows the experts here can receive from all ranks (each rank
  // routes as many rows): a token's k slots go to k distinct experts, at
  // most min(k, local) of them here, and with capacity each expert takes at
  // most its capacity per sequence from each rank.
  int64_t expert_rows(const Rows& rows) const;
  // Runs the experts here over their rows (offsets: local expert e's rows).
  void experts_forward(const ParamStore<T>& ps, T* rec, bool selective, T* y, const T* xrows,
                       const std::vector<int64_t>& offsets, T* recompute) const;
  void experts_backward(const ParamStore<T>& ps, T* rec, bool selective, T* dx, const T* dy,
                        const T* xrows, const std::vector<int64_t>& offsets, T* scratch,
                        T* recompute) const;

  int64_t C_;
  MoeConfig config_;
  std::shared_ptr<ExpertDispatcher<T>> dispatcher_;
  std::shared_ptr<RowSplit<T>> split_;
  std::shared_ptr<SequenceGather<T>> context_;
  int first_ = 0;
  std::vector<std::unique_ptr<Mlp<T>>> experts_;
  double loss_weight_ = 1.0;
  const int32_t* ids_ = nullptr;
  int64_t history_ = 0;
  mutable MoeStats stats_;
};

}  // namespace loom
