// Context parallelism's attention core: each sequence is cut into 2 x cp
// chunks and rank r of the context-parallel group holds two of them
// (ContextSplit: r and 2 cp - 1 - r, so every rank has the same causal
// work); its queries attend to every rank's keys and values, one of three
// ways (parallel.context_comm):
//
//   p2p         a ring: each rank passes the keys and values it holds to the
//               next while the attention runs on them (chunk pairs merged by
//               the log-sum-exp); backward passes them round again, and the
//               gradient of each rank's keys and values travels round with
//               them back to its owner.
//   all_gather  every rank's keys and values gathered before the attention;
//               backward reduce-scatters their gradients to their owners.
//   a2a         an all-to-all turns the sequence split into a head split:
//               each rank runs the whole-sequence kernel on n_head / cp of
//               the heads, and a second all-to-all turns the output back.
//
// Everything is keyed on global positions (the causal mask and the
// dropout masks on the probabilities), so a context-parallel run computes
// the attention of one process, up to the order of floating-point sums.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "loom/comm/process_group.h"
#include "loom/nn/attention.h"
#include "loom/nn/moe.h"

namespace loom::context {

enum class ContextComm { kP2p, kAllGather, kA2a };
ContextComm parse_context_comm(const std::string& s);  // "p2p", "all_gather", "a2a"

// What the attention cores did since the last take_stats(): time in the
// attention kernels; time the keys' and values' transfers were under way
// (a ring step's receive, a collective; the MoE layers' routing gathers
// too) and the part of it spent waiting (with p2p the rest ran beside the
// attention); bytes this rank sent.
struct ContextStats {
  double attention_s = 0;
  double comm_s = 0;
  double exposed_s = 0;
  int64_t sent_bytes = 0;
};

class ContextAttention final : public AttentionCore<float> {
 public:
  // group: the context-parallel group (ParallelContext::cp), more than one rank.
  ContextAttention(std::shared_ptr<ProcessGroup> group, ContextComm comm, bool balanced = true);
  ContextSplit split() const { return split_of(group_->rank()); }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

  void forward(const Backend<float>& be, float* y, float* lse, const float* qkv, int64_t B,
               int64_t Tn, int64_t C, int64_t NH, const DropoutSpec& probs) const override;
  void backward(const Backend<float>& be, float* dqkv, const float* dy, const float* qkv,
                const float* y, const float* lse, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                const DropoutSpec& probs) const override;

  ContextStats take_stats() const;
  // A collective of the MoE layers' routing (ContextGather), counted in.
  void add_blocking(double seconds, int64_t sent_bytes) const {
    stats_.comm_s += seconds, stats_.exposed_s += seconds, stats_.sent_bytes += sent_bytes;
  }

 private:
  ContextSplit split_of(int rank) const { return ContextSplit{rank, group_->size(), balanced_}; }
  AttentionChunk pair(int qk, int src, int kk, int64_t B, int64_t Tn, int64_t C, int64_t NH) const;
  // The attention of this rank's two query chunks against the two key
  // chunks of `src` held in kv (B, Tn, 2C; k | v).
  void attend(const Backend<float>& be, float* y, float* lse, const float* qkv, const float* kv,
              int src, int64_t B, int64_t Tn, int64_t C, int64_t NH,
              const DropoutSpec& probs) const;
  void attend_backward(const Backend<float>& be, float* dqkv, float* dkv, const float* dy,
                       const float* qkv, const float* kv, const float* y, const float* lse, int src,
                       int64_t B, int64_t Tn, int64_t C, int64_t NH,
                       const DropoutSpec& probs) const;
  void forward_ring(const Backend<float>& be, float* y, float* lse, const float* qkv, int64_t B,
                    int64_t Tn, int64_t C, int64_t NH, const DropoutSpec& probs) const;
  void backward_ring(const Backend<float>& be, float* dqkv, const float* dy, const float* qkv,
                     const float* y, const float* lse, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                     const DropoutSpec& probs) const;
  void forward_gather(const Backend<float>& be, float* y, float* lse, const float* qkv, int64_t B,
                      int64_t Tn, int64_t C, int64_t NH, const DropoutSpec& probs) const;
  void backward_gather(const Backend<float>& be, float* dqkv, const float* dy, const float* qkv,
                       const float* y, const float* lse, int64_t B, int64_t Tn, int64_t C,
                       int64_t NH, const DropoutSpec& probs) const;
  void forward_a2a(const Backend<float>& be, float* y, float* lse, const float* qkv, int64_t B,
                   int64_t Tn, int64_t C, int64_t NH, const DropoutSpec& probs) const;
  void backward_a2a(const Backend<float>& be, float* dqkv, const float* dy, const float* qkv,
                    const float* y, const float* lse, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                    const DropoutSpec& probs) const;
  // a2a: local rows (B, Tn, W) holding `parts` blocks of width W / parts
  // side by side (q | k | v: 3) to this rank's head share of every rank's
  // rows in sequence order (B, cp Tn, W / cp), and back.
  void to_heads(const Backend<float>& be, const float* local, float* heads, int64_t B, int64_t Tn,
                int64_t W, int parts) const;
  void to_rows(const Backend<float>& be, const float* heads, float* local, int64_t B, int64_t Tn,
               int64_t W, int parts) const;
  // Waits for w (exposed time); its duration counts as transfer time
  // unless it is the send of a pair whose receive is counted.
  void wait(const WorkPtr& w, bool transfer = true) const;
  // One hop of the ring: this rank's buffer on to r + 1, the next from r - 1.
  struct Pass {
    WorkPtr sent, got;
  };
  Pass start_pass(const float* mine, float* next, int64_t n, int tag, const char* what) const;
  void finish(const Pass& p) const;

  std::shared_ptr<ProcessGroup> group_;
  ContextComm comm_;
  bool balanced_;
  mutable ContextStats stats_;
};

// The MoE layers' routing under context parallelism: every rank's router
// logits (or token ids) gathered over the context-parallel group, so each
// routes whole sequences (nn/moe.h, SequenceGather).
class ContextGather final : public SequenceGather<float> {
 public:
  // Over the attention's group, its time counted in the attention's stats.
  explicit ContextGather(std::shared_ptr<const ContextAttention> attention)
      : attention_(std::move(attention)) {}
  ContextSplit split() const override { return attention_->split(); }
  void gather(const float* mine, int64_t n, float* all) override;
  void gather_ids(const int32_t* mine, int64_t n, int32_t* all) override;

 private:
  std::shared_ptr<const ContextAttention> attention_;
};

}  // namespace loom::context
