#include "loom/comm/algorithms/allreduce.h"

#include <algorithm>
#include <climits>
#include <vector>

#include "loom/core/error.h"

namespace loom::algo {

namespace {

constexpr size_t kSegment = 1 << 18;  // elements per pipelined segment (1 MiB of f32)

void combine(float* dst, const float* src, size_t n, ReduceOp op) {
  if (op == ReduceOp::kMax) {
    for (size_t i = 0; i < n; ++i) dst[i] = std::max(dst[i], src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] += src[i];
  }
}

int as_int(size_t n) {
  LOOM_CHECK(n <= static_cast<size_t>(INT_MAX), "message of {} elements exceeds MPI's int count",
             n);
  return static_cast<int>(n);
}

// Sends send[0, n_send) to `to` while receiving n_recv into recv from `from`;
// with reduce, the received data is combined into `dst` segment by segment.
void exchange(const P2p& g, const float* send, size_t n_send, int to, float* recv, size_t n_recv,
              int from, int tag, float* reduce_into, ReduceOp op) {
  std::vector<MPI_Request> sends, recvs;
  g.count_sent(n_send);
  for (size_t off = 0; off < n_send; off += kSegment) {
    sends.emplace_back();
    MPI_Isend(send + off, as_int(std::min(kSegment, n_send - off)), MPI_FLOAT, to, tag, g.comm,
              &sends.back());
  }
  for (size_t off = 0; off < n_recv; off += kSegment) {
    recvs.emplace_back();
    MPI_Irecv(recv + off, as_int(std::min(kSegment, n_recv - off)), MPI_FLOAT, from, tag, g.comm,
              &recvs.back());
  }
  // Segments arrive in order on one pair; reduce each as soon as it is here.
  for (size_t k = 0; k < recvs.size(); ++k) {
    g.wait(&recvs[k], 1);
    if (reduce_into != nullptr) {
      size_t off = k * kSegment;
      combine(reduce_into + off, recv + off, std::min(kSegment, n_recv - off), op);
    }
  }
  if (!sends.empty()) g.wait(sends.data(), static_cast<int>(sends.size()));
}

}  // namespace

void ring_reduce_scatter(const P2p& g, float* data, size_t count, ReduceOp op) {
  const int p = g.size, r = g.rank;
  if (p == 1) return;
  const int right = (r + 1) % p, left = (r - 1 + p) % p;
  std::vector<float> tmp(count / static_cast<size_t>(p) + 1);
  // Step s: send chunk (r - s - 1), receive chunk (r - s - 2) and add; after
  // p - 1 steps rank r holds the full sum of chunk r.
  for (int s = 0; s < p - 1; ++s) {
    int send_chunk = ((r - s - 1) % p + p) % p, recv_chunk = ((r - s - 2) % p + p) % p;
    size_t sb = chunk_begin(count, p, send_chunk), se = chunk_begin(count, p, send_chunk + 1);
    size_t rb = chunk_begin(count, p, recv_chunk), re = chunk_begin(count, p, recv_chunk + 1);
    exchange(g, data + sb, se - sb, right, tmp.data(), re - rb, left, kAlgoTagBase + 1, data + rb,
             op);
  }
}

void ring_all_gather(const P2p& g, float* data, size_t count) {
  const int p = g.size, r = g.rank;
  if (p == 1) return;
  const int right = (r + 1) % p, left = (r - 1 + p) % p;
  // Step s: pass on chunk (r - s), receive chunk (r - s - 1) in place.
  for (int s = 0; s < p - 1; ++s) {
    int send_chunk = ((r - s) % p + p) % p, recv_chunk = ((r - s - 1) % p + p) % p;
    size_t sb = chunk_begin(count, p, send_chunk), se = chunk_begin(count, p, send_chunk + 1);
    size_t rb = chunk_begin(count, p, recv_chunk), re = chunk_begin(count, p, recv_chunk + 1);
    exchange(g, data + sb, se - sb, right, data + rb, re - rb, left, kAlgoTagBase + 2, nullptr,
             ReduceOp::kSum);
  }
}

void ring_all_reduce(const P2p& g, float* data, size_t count, ReduceOp op) {
  ring_reduce_scatter(g, data, count, op);
  ring_all_gather(g, data, count);
}

void rhd_all_reduce(const P2p& g, float* data, size_t count, ReduceOp op) {
  const int p = g.size, r = g.rank;
  if (p == 1 || count == 0) return;
  int pof2 = 1;
  while (pof2 * 2 <= p) pof2 *= 2;
  const int extra = p - pof2;
  std::vector<float> tmp(count);
  // Fold: among the first 2 * extra ranks, even ranks hand their data to the
  // odd rank above and sit out; the rest renumber to 0 .. pof2 - 1.
  int vrank;
  if (r < 2 * extra) {
    if (r % 2 == 0) {
      MPI_Request req;
      g.count_sent(count);
      MPI_Isend(data, as_int(count), MPI_FLOAT, r + 1, kAlgoTagBase + 3, g.comm, &req);
      g.wait(&req, 1);
      vrank = -1;
    } else {
      MPI_Request req;
      MPI_Irecv(tmp.data(), as_int(count), MPI_FLOAT, r - 1, kAlgoTagBase + 3, g.comm, &req);
      g.wait(&req, 1);
      combine(data, tmp.data(), count, op);
      vrank = r / 2;
    }
  } else {
    vrank = r - extra;
  }
  auto real = [extra](int v) { return v < extra ? 2 * v + 1 : v + extra; };
  if (vrank >= 0) {
    // Recursive halving: keep the half of [lo, hi) on my side of the partner.
    size_t lo = 0, hi = count;
    std::vector<std::pair<size_t, size_t>> ranges;
    for (int d = pof2 / 2; d >= 1; d /= 2) {
      int partner = vrank ^ d;
      size_t mid = lo + (hi - lo) / 2;
      bool keep_low = vrank < partner;
      size_t keep_b = keep_low ? lo : mid, keep_e = keep_low ? mid : hi;
      size_t send_b = keep_low ? mid : lo, send_e = keep_low ? hi : mid;
      exchange(g, data + send_b, send_e - send_b, real(partner), tmp.data() + keep_b,
               keep_e - keep_b, real(partner), kAlgoTagBase + 4, data + keep_b, op);
      ranges.push_back({lo, hi});
      lo = keep_b, hi = keep_e;
    }
    // Recursive doubling: give my reduced range, receive the partner's.
    for (int d = 1, k = static_cast<int>(ranges.size()) - 1; d < pof2; d *= 2, --k) {
      int partner = vrank ^ d;
      auto [plo, phi] = ranges[k];
      size_t other_b = lo == plo ? hi : plo, other_e = lo == plo ? phi : lo;
      exchange(g, data + lo, hi - lo, real(partner), data + other_b, other_e - other_b,
               real(partner), kAlgoTagBase + 5, nullptr, op);
      lo = plo, hi = phi;
    }
  }
  // Unfold: odd ranks return the result to the even rank that sat out.
  if (r < 2 * extra) {
    MPI_Request req;
    if (r % 2 == 1) {
      g.count_sent(count);
      MPI_Isend(data, as_int(count), MPI_FLOAT, r - 1, kAlgoTagBase + 6, g.comm, &req);
    } else {
      MPI_Irecv(data, as_int(count), MPI_FLOAT, r + 1, kAlgoTagBase + 6, g.comm, &req);
    }
    g.wait(&req, 1);
  }
}

void hierarchical_all_reduce(const P2p& node, const P2p& cross, float* data, size_t count,
                             ReduceOp op) {
  ring_reduce_scatter(node, data, count, op);
  size_t b = chunk_begin(count, node.size, node.rank),
         e = chunk_begin(count, node.size, node.rank + 1);
  ring_all_reduce(cross, data + b, e - b, op);
  ring_all_gather(node, data, count);
}

}  // namespace loom::algo
