// The router of a mixture-of-experts layer: which experts each token goes
// to and with what weight, and the losses that keep the experts' load even.
// The router's linear (C -> E logits) is the caller's GEMM; this is what
// follows it, forward and backward:
//   probs  = softmax(logits) over the E experts, per token;
//   top-k  = the k largest probabilities (a tie goes to the lower expert);
//   gates  = the chosen probabilities renormalised to sum to 1 when k > 1
//            (GShard, Mixtral); the probability itself when k = 1 (Switch,
//            whose gate would otherwise always be 1);
//   capacity: within a routing group (one sequence, so that no layout
//            changes who competes) an expert takes at most
//            ceil(capacity_factor x group tokens x k / E) assignments, by
//            gate value, then token, then slot; the rest are dropped (their
//            token passes through the residual for that slot). 0: no limit.
//   aux    = the Switch load-balancing loss per group, E x sum_i f_i P_i
//            (f_i: the share of the group's k x tokens assignments that chose
//            expert i before dropping; P_i: the mean of expert i's
//            probability over the group's tokens), averaged over the groups;
//   z      = the router z-loss, the mean over tokens of logsumexp(logits)^2.
// Both losses are means over groups or tokens of the micro-batch, weighted
// by the caller like the main loss, so every layout sums the same terms.
//
// Fixed routers choose from the token ids instead, with no router weights,
// no losses and gates of 1/k (fixed_experts, route_fixed):
//   hash   the k experts with the smallest hash of (token id, expert): a
//          fixed pseudo-random assignment of the vocabulary, even over it
//          in expectation (Hash Layers);
//   tag    by a task or language tag in the data: a token goes where the
//          last tag token (tag_tokens[i]: tag i) at or before it in its
//          sample says, experts (i k + j) mod E for j < k; tokens before the
//          sample's first tag token go as tag 0 (so samples should start
//          with their tag).
#pragma once

#include <cstdint>
#include <vector>

namespace loom {

enum class RouterKind { kLearned, kHash, kTag };

struct RouterConfig {
  int num_experts = 8;
  int top_k = 2;
  double capacity_factor = 0;  // 0: no dropping
  RouterKind kind = RouterKind::kLearned;
  std::vector<int32_t> tag_tokens;  // kTag
};

template <typename T>
struct Routing {
  int64_t tokens = 0, group = 0;
  int k = 0, experts = 0;
  int64_t capacity = 0;         // per expert and group; 0: unlimited
  std::vector<int32_t> expert;  // (tokens, k): the chosen expert, by rank of its probability
  std::vector<T> gate;          // (tokens, k): its gate
  std::vector<uint8_t> kept;    // (tokens, k): 0 where capacity dropped the assignment
  std::vector<T> probs;         // (tokens, E)
  std::vector<T> lse;           // (tokens): logsumexp of the logits
  std::vector<int64_t> load;    // (E): assignments chosen (before dropping)
  int64_t dropped = 0;          // assignments dropped
  double aux = 0, z = 0;        // the losses (unweighted)
};

// Routes `tokens` rows of logits (tokens, E), `group` consecutive tokens to a
// routing group (tokens must be a multiple of it). `bias` (E, or null): the
// auxiliary-loss-free balancing's per-expert bias, added to the
// probabilities for choosing the top k only (the gates stay the
// probabilities').
template <typename T>
Routing<T> route(const T* logits, int64_t tokens, int64_t group, const RouterConfig& c,
                 const T* bias = nullptr);

// A fixed router's choice (c.kind hash or tag): experts (tokens, k) for the
// token ids (tokens, `group` to a sample). `history` ids before ids[0] are
// readable and belong to the first sample (a decoded sequence's earlier
// tokens: the tag router looks back into them).
void fixed_experts(const int32_t* ids, int64_t tokens, int64_t group, const RouterConfig& c,
                   int32_t* experts, int64_t history = 0);
// The routing of those choices: gates 1/k, capacity as for route(), no
// losses (probs and lse empty).
template <typename T>
Routing<T> route_fixed(const int32_t* experts, int64_t tokens, int64_t group,
                       const RouterConfig& c);

// dlogits (tokens, E) = d/dlogits of sum(dgate * gate) (dgate (tokens, k):
// the loss's gradient with respect to each gate; a dropped assignment's is
// ignored) + aux_weight * aux + z_weight * z. Overwrites dlogits.
template <typename T>
void route_backward(const Routing<T>& r, const T* dgate, double aux_weight, double z_weight,
                    T* dlogits);

// The kept assignments in dispatch order: grouped by expert (expert 0's
// first, so a contiguous range of experts is a contiguous range of rows,
// what an all-to-all sends to the rank holding them), within an expert by
// token, then slot. Each expert then runs one GEMM over its rows.
struct Dispatch {
  std::vector<int64_t> offsets;  // (E + 1): expert e's rows are [offsets[e], offsets[e + 1])
  std::vector<int64_t> slot;     // per row: its assignment, token x k + slot
};
template <typename T>
Dispatch dispatch_order(const Routing<T>& r);

// rows (n, C), n = d.slot.size(): row i is x's row of its assignment's token.
template <typename T>
void gather_rows(const Dispatch& d, int k, const T* x, int64_t C, T* rows);
// dx (tokens, C) += the rows' gradients, each added to its token's row.
template <typename T>
void gather_rows_backward(const Dispatch& d, int k, const T* drows, int64_t C, T* dx);
// out (tokens, C) += gate x y's row, for every row (the experts' outputs
// combined; a token whose every assignment was dropped gets nothing).
template <typename T>
void combine_rows(const Dispatch& d, const Routing<T>& r, const T* y, int64_t C, T* out);
// From dout (tokens, C): dy (n, C) = gate x dout's row; dgate (tokens, k)
// = <dout's row, y's row> for each kept assignment, 0 for a dropped one.
template <typename T>
void combine_rows_backward(const Dispatch& d, const Routing<T>& r, const T* y, const T* dout,
                           int64_t C, T* dy, T* dgate);

}  // namespace loom
