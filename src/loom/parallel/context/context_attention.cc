#include "loom/parallel/context/context_attention.h"

#include <chrono>
#include <limits>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom::context {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr int kKvTag = 0, kGradTag = 1;

// kv (B, Tn, 2C) = the k | v columns of qkv (B, Tn, 3C).
void pack_kv(const Backend<float>& be, float* kv, const float* qkv, int64_t B, int64_t Tn,
             int64_t C) {
  for (int64_t r = 0; r < B * Tn; ++r) be.copy(kv + r * 2 * C, qkv + r * 3 * C + C, 2 * C);
}

// The k | v columns of dqkv (B, Tn, 3C) += dkv (B, Tn, 2C).
void add_kv(const Backend<float>& be, float* dqkv, const float* dkv, int64_t B, int64_t Tn,
            int64_t C) {
  for (int64_t r = 0; r < B * Tn; ++r) be.add(dqkv + r * 3 * C + C, dkv + r * 2 * C, 2 * C);
}

Buffer workspace(const Backend<float>& be, int64_t n) {
  return be.alloc(static_cast<size_t>(n) * sizeof(float), MemCategory::kComm, false);
}

}  // namespace

ContextComm parse_context_comm(const std::string& s) {
  if (s == "p2p") return ContextComm::kP2p;
  if (s == "all_gather") return ContextComm::kAllGather;
  if (s == "a2a") return ContextComm::kA2a;
  LOOM_FAIL(kConfig, "parallel.context_comm: unknown value '{}' (p2p, all_gather, a2a)", s);
}

ContextAttention::ContextAttention(std::shared_ptr<ProcessGroup> group, ContextComm comm,
                                   bool balanced)
    : group_(std::move(group)), comm_(comm), balanced_(balanced) {
  LOOM_CHECK(group_ && group_->size() > 1, "context parallelism needs a group of several ranks");
}

ContextStats ContextAttention::take_stats() const {
  ContextStats s = stats_;
  stats_ = {};
  return s;
}

void ContextAttention::wait(const WorkPtr& w, bool transfer) const {
  const auto t0 = Clock::now();
  w->wait();
  stats_.exposed_s += since(t0);
  if (transfer) stats_.comm_s += w->seconds();
}

// Chunk pair (this rank's query chunk qk, src's key chunk kk) of local
// sequences of Tn tokens: q in qkv (B, Tn, 3C), keys and values in kv (B,
// Tn, 2C), out (B, Tn, C), lse (B, NH, Tn), each at its chunk's rows.
AttentionChunk ContextAttention::pair(int qk, int src, int kk, int64_t B, int64_t Tn, int64_t C,
                                      int64_t NH) const {
  const int64_t Tc = Tn / 2;
  AttentionChunk a;
  a.B = B, a.NH = NH, a.C = C, a.Tq = Tc, a.Tk = Tc;
  a.q_pos = split().chunk(qk) * Tc, a.k_pos = split_of(src).chunk(kk) * Tc;
  a.q_row = 3 * C, a.q_batch = Tn * 3 * C;
  a.kv_row = 2 * C, a.kv_batch = Tn * 2 * C, a.v_col = C;
  a.o_row = C, a.o_batch = Tn * C, a.lse_batch = NH * Tn, a.lse_head = Tn;
  return a;
}

void ContextAttention::attend(const Backend<float>& be, float* y, float* lse, const float* qkv,
                              const float* kv, int src, int64_t B, int64_t Tn, int64_t C,
                              int64_t NH, const DropoutSpec& probs) const {
  const auto t0 = Clock::now();
  const int64_t Tc = Tn / 2;
  for (int qk = 0; qk < 2; ++qk)
    for (int kk = 0; kk < 2; ++kk) {
      const AttentionChunk a = pair(qk, src, kk, B, Tn, C, NH);
      if (!a.visible()) continue;
      be.attention_chunk_forward(y + qk * Tc * C, lse + qk * Tc, qkv + qk * Tc * 3 * C,
                                 kv + kk * Tc * 2 * C, a, probs);
    }
  stats_.attention_s += since(t0);
}

void ContextAttention::attend_backward(const Backend<float>& be, float* dqkv, float* dkv,
                                       const float* dy, const float* qkv, const float* kv,
                                       const float* y, const float* lse, int src, int64_t B,
                                       int64_t Tn, int64_t C, int64_t NH,
                                       const DropoutSpec& probs) const {
  const auto t0 = Clock::now();
  const int64_t Tc = Tn / 2;
  for (int qk = 0; qk < 2; ++qk)
    for (int kk = 0; kk < 2; ++kk) {
      const AttentionChunk a = pair(qk, src, kk, B, Tn, C, NH);
      if (!a.visible()) continue;
      be.attention_chunk_backward(dqkv + qk * Tc * 3 * C, dkv + kk * Tc * 2 * C, dy + qk * Tc * C,
                                  qkv + qk * Tc * 3 * C, kv + kk * Tc * 2 * C, y + qk * Tc * C,
                                  lse + qk * Tc, a, probs);
    }
  stats_.attention_s += since(t0);
}

void ContextAttention::forward(const Backend<float>& be, float* y, float* lse, const float* qkv,
                               int64_t B, int64_t Tn, int64_t C, int64_t NH,
                               const DropoutSpec& probs) const {
  LOOM_CHECK(Tn % 2 == 0, "a context-parallel rank holds two chunks; {} local tokens", Tn);
  switch (comm_) {
    case ContextComm::kP2p:
      return forward_ring(be, y, lse, qkv, B, Tn, C, NH, probs);
    case ContextComm::kAllGather:
      return forward_gather(be, y, lse, qkv, B, Tn, C, NH, probs);
    case ContextComm::kA2a:
      return forward_a2a(be, y, lse, qkv, B, Tn, C, NH, probs);
  }
}

void ContextAttention::backward(const Backend<float>& be, float* dqkv, const float* dy,
                                const float* qkv, const float* y, const float* lse, int64_t B,
                                int64_t Tn, int64_t C, int64_t NH, const DropoutSpec& probs) const {
  switch (comm_) {
    case ContextComm::kP2p:
      return backward_ring(be, dqkv, dy, qkv, y, lse, B, Tn, C, NH, probs);
    case ContextComm::kAllGather:
      return backward_gather(be, dqkv, dy, qkv, y, lse, B, Tn, C, NH, probs);
    case ContextComm::kA2a:
      return backward_a2a(be, dqkv, dy, qkv, y, lse, B, Tn, C, NH, probs);
  }
}

// ---- p2p: the ring ----------------------------------------------------------

// mine (n) to rank r + 1 and the next (n) from rank r - 1, both started.
ContextAttention::Pass ContextAttention::start_pass(const float* mine, float* next, int64_t n,
                                                    int tag, const char* what) const {
  const int P = group_->size(), r = group_->rank();
  Pass p;
  p.sent = group_->send(mine, static_cast<size_t>(n), DType::kF32, (r + 1) % P, tag, what);
  p.got = group_->recv(next, static_cast<size_t>(n), DType::kF32, (r + P - 1) % P, tag, what);
  stats_.sent_bytes += n * 4;
  return p;
}

// The receive is the transfer; the send's wait is only exposed time.
void ContextAttention::finish(const Pass& p) const {
  wait(p.got);
  wait(p.sent, false);
}

// Step s: this rank holds the keys and values of rank (r - s) mod cp, sends
// them on to r + 1 and receives the next from r - 1 while it attends.
void ContextAttention::forward_ring(const Backend<float>& be, float* y, float* lse,
                                    const float* qkv, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                    const DropoutSpec& probs) const {
  const int P = group_->size(), r = group_->rank();
  const int64_t n = B * Tn * 2 * C;
  Buffer bufs = workspace(be, 2 * n);
  float* cur = bufs.as<float>();
  float* nxt = cur + n;
  pack_kv(be, cur, qkv, B, Tn, C);
  be.fill(y, B * Tn * C, 0.0f);
  be.fill(lse, B * NH * Tn, -std::numeric_limits<float>::infinity());
  for (int s = 0; s < P; ++s) {
    const Pass pass =
        s + 1 < P ? start_pass(cur, nxt, n, kKvTag, "the keys and values of the context ring")
                  : Pass{};
    attend(be, y, lse, qkv, cur, (r - s + P) % P, B, Tn, C, NH, probs);
    if (s + 1 < P) {
      finish(pass);
      std::swap(cur, nxt);
    }
  }
}

// The keys and values go round again; each rank's contribution to the
// gradient of the keys and values it holds is added to what came with them
// and passed on, so after the last step every rank receives its own.
void ContextAttention::backward_ring(const Backend<float>& be, float* dqkv, const float* dy,
                                     const float* qkv, const float* y, const float* lse, int64_t B,
                                     int64_t Tn, int64_t C, int64_t NH,
                                     const DropoutSpec& probs) const {
  const int P = group_->size(), r = group_->rank();
  const int64_t n = B * Tn * 2 * C;
  Buffer bufs = workspace(be, 5 * n);
  float* cur = bufs.as<float>();
  float* nxt = cur + n;
  float* mine[2] = {cur + 2 * n, cur + 3 * n};  // this step's gradient, double-buffered
  float* in = cur + 4 * n;                      // the gradient passed in from r - 1
  pack_kv(be, cur, qkv, B, Tn, C);
  WorkPtr grad_sent[2], grad_got;
  for (int s = 0; s < P; ++s) {
    const Pass pass = s + 1 < P ? start_pass(cur, nxt, n, kKvTag,
                                             "the keys and values of the context ring (backward)")
                                : Pass{};
    float* g = mine[s % 2];
    if (grad_sent[s % 2]) wait(grad_sent[s % 2], false);
    be.fill(g, n, 0.0f);
    attend_backward(be, dqkv, g, dy, qkv, cur, y, lse, (r - s + P) % P, B, Tn, C, NH, probs);
    if (s > 0) {
      wait(grad_got);
      be.add(g, in, n);
    }
    const Pass grads =
        start_pass(g, in, n, kGradTag, "the key and value gradients of the context ring");
    grad_sent[s % 2] = grads.sent;
    grad_got = grads.got;
    if (s + 1 < P) {
      finish(pass);
      std::swap(cur, nxt);
    }
  }
  wait(grad_got);  // this rank's own, complete
  add_kv(be, dqkv, in, B, Tn, C);
  for (const WorkPtr& w : grad_sent)
    if (w) wait(w, false);
}

// ---- all_gather -------------------------------------------------------------

void ContextAttention::forward_gather(const Backend<float>& be, float* y, float* lse,
                                      const float* qkv, int64_t B, int64_t Tn, int64_t C,
                                      int64_t NH, const DropoutSpec& probs) const {
  const int P = group_->size();
  const int64_t n = B * Tn * 2 * C;
  Buffer bufs = workspace(be, (P + 1) * n);
  float* mine = bufs.as<float>();
  float* all = mine + n;
  pack_kv(be, mine, qkv, B, Tn, C);
  wait(group_->all_gather(mine, all, static_cast<size_t>(n), DType::kF32));
  stats_.sent_bytes += n * 4 * (P - 1);
  be.fill(y, B * Tn * C, 0.0f);
  be.fill(lse, B * NH * Tn, -std::numeric_limits<float>::infinity());
  for (int src = 0; src < P; ++src)
    attend(be, y, lse, qkv, all + src * n, src, B, Tn, C, NH, probs);
}

void ContextAttention::backward_gather(const Backend<float>& be, float* dqkv, const float* dy,
                                       const float* qkv, const float* y, const float* lse,
                                       int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                       const DropoutSpec& probs) const {
  const int P = group_->size();
  const int64_t n = B * Tn * 2 * C;
  Buffer bufs = workspace(be, (2 * P + 1) * n);
  float* all = bufs.as<float>();
  float* grads = all + P * n;
  float* own = grads + P * n;
  pack_kv(be, own, qkv, B, Tn, C);
  wait(group_->all_gather(own, all, static_cast<size_t>(n), DType::kF32));
  be.fill(grads, P * n, 0.0f);
  for (int src = 0; src < P; ++src)
    attend_backward(be, dqkv, grads + src * n, dy, qkv, all + src * n, y, lse, src, B, Tn, C, NH,
                    probs);
  wait(group_->reduce_scatter(grads, own, static_cast<size_t>(n), DType::kF32, ReduceOp::kSum));
  stats_.sent_bytes += 2 * n * 4 * (P - 1);
  add_kv(be, dqkv, own, B, Tn, C);
}

// ---- a2a: sequence split <-> head split -------------------------------------

void ContextAttention::to_heads(const Backend<float>& be, const float* local, float* heads,
                                int64_t B, int64_t Tn, int64_t W, int parts) const {
  const int P = group_->size();
  const int64_t w = W / P, pw = W / parts, ps = pw / P;  // out width, part width, part share
  const int64_t block = B * Tn * w;
  Buffer bufs = workspace(be, 2 * P * block);
  float* send = bufs.as<float>();
  float* recv = send + P * block;
  for (int d = 0; d < P; ++d)
    for (int64_t row = 0; row < B * Tn; ++row)
      for (int p = 0; p < parts; ++p)
        be.copy(send + d * block + row * w + p * ps, local + row * W + p * pw + d * ps, ps);
  const std::vector<size_t> counts(static_cast<size_t>(P), static_cast<size_t>(block));
  wait(group_->all_to_all(send, counts, recv, counts, DType::kF32));
  stats_.sent_bytes += block * 4 * (P - 1);
  const int64_t T = Tn * P;
  for (int s = 0; s < P; ++s) {
    const ContextSplit from = split_of(s);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tn; ++t)
        be.copy(heads + (b * T + from.position(t, Tn)) * w, recv + s * block + (b * Tn + t) * w, w);
  }
}

void ContextAttention::to_rows(const Backend<float>& be, const float* heads, float* local,
                               int64_t B, int64_t Tn, int64_t W, int parts) const {
  const int P = group_->size();
  const int64_t w = W / P, pw = W / parts, ps = pw / P;
  const int64_t block = B * Tn * w, T = Tn * P;
  Buffer bufs = workspace(be, 2 * P * block);
  float* send = bufs.as<float>();
  float* recv = send + P * block;
  for (int d = 0; d < P; ++d) {
    const ContextSplit to = split_of(d);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tn; ++t)
        be.copy(send + d * block + (b * Tn + t) * w, heads + (b * T + to.position(t, Tn)) * w, w);
  }
  const std::vector<size_t> counts(static_cast<size_t>(P), static_cast<size_t>(block));
  wait(group_->all_to_all(send, counts, recv, counts, DType::kF32));
  stats_.sent_bytes += block * 4 * (P - 1);
  for (int s = 0; s < P; ++s)
    for (int64_t row = 0; row < B * Tn; ++row)
      for (int p = 0; p < parts; ++p)
        be.copy(local + row * W + p * pw + s * ps, recv + s * block + row * w + p * ps, ps);
}

// This rank runs heads [r NH / cp, (r + 1) NH / cp) of this rank's NH over
// the whole sequence; lse holds their (B, NH / cp, cp Tn) log-sum-exps.
void ContextAttention::forward_a2a(const Backend<float>& be, float* y, float* lse, const float* qkv,
                                   int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                   const DropoutSpec& probs) const {
  const int P = group_->size();
  LOOM_CHECK_KIND(kConfig, NH % P == 0,
                  "parallel.context_comm a2a: {} heads here do not split over parallel.context {}",
                  NH, P);
  const int64_t T = Tn * P, Ch = C / P, NHh = NH / P;
  Buffer bufs = workspace(be, B * T * 3 * Ch + B * T * Ch);
  float* qkv_h = bufs.as<float>();
  float* y_h = qkv_h + B * T * 3 * Ch;
  to_heads(be, qkv, qkv_h, B, Tn, 3 * C, 3);
  DropoutSpec heads = probs;
  heads.site += static_cast<uint32_t>(group_->rank() * NHh);
  const auto t0 = Clock::now();
  be.attention_forward(y_h, lse, qkv_h, B, T, Ch, NHh, heads);
  stats_.attention_s += since(t0);
  to_rows(be, y_h, y, B, Tn, C, 1);
}

void ContextAttention::backward_a2a(const Backend<float>& be, float* dqkv, const float* dy,
                                    const float* qkv, const float* y, const float* lse, int64_t B,
                                    int64_t Tn, int64_t C, int64_t NH,
                                    const DropoutSpec& probs) const {
  const int P = group_->size();
  const int64_t T = Tn * P, Ch = C / P, NHh = NH / P;
  Buffer bufs = workspace(be, 2 * B * T * 3 * Ch + 2 * B * T * Ch + B * Tn * 3 * C);
  float* qkv_h = bufs.as<float>();
  float* dqkv_h = qkv_h + B * T * 3 * Ch;
  float* y_h = dqkv_h + B * T * 3 * Ch;
  float* dy_h = y_h + B * T * Ch;
  float* d_local = dy_h + B * T * Ch;
  to_heads(be, qkv, qkv_h, B, Tn, 3 * C, 3);
  to_heads(be, y, y_h, B, Tn, C, 1);
  to_heads(be, dy, dy_h, B, Tn, C, 1);
  DropoutSpec heads = probs;
  heads.site += static_cast<uint32_t>(group_->rank() * NHh);
  const auto t0 = Clock::now();  // the kernel writes dqkv_h whole
  be.attention_backward(dqkv_h, dy_h, qkv_h, y_h, lse, B, T, Ch, NHh, heads);
  stats_.attention_s += since(t0);
  to_rows(be, dqkv_h, d_local, B, Tn, 3 * C, 3);
  be.add(dqkv, d_local, B * Tn * 3 * C);
}

void ContextGather::gather(const float* mine, int64_t n, float* all) {
  const auto t0 = Clock::now();
  const auto& g = attention_->group();
  g->all_gather(mine, all, static_cast<size_t>(n), DType::kF32)->wait();
  attention_->add_blocking(since(t0), n * 4 * (g->size() - 1));
}

// Token ids travel as 4-byte words: an all-gather moves bytes and never
// does arithmetic on them, so they arrive unchanged.
void ContextGather::gather_ids(const int32_t* mine, int64_t n, int32_t* all) {
  static_assert(sizeof(int32_t) == sizeof(float));
  const auto t0 = Clock::now();
  const auto& g = attention_->group();
  g->all_gather(mine, all, static_cast<size_t>(n), DType::kF32)->wait();
  attention_->add_blocking(since(t0), n * 4 * (g->size() - 1));
}

}  // namespace loom::context
