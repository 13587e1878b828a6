// The MPI backend's collectives, point-to-point messages and barrier: each
// enqueued on the group's worker (mpi_process_group.cc), which records it.
#include <algorithm>
#include <cstring>
#include <vector>

#include "loom/comm/algorithms/allreduce.h"
#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/comm/mpi/mpi_transport.h"
#include "loom/core/error.h"

namespace loom {

using mpi::as_int;
using mpi::F32View;
using mpi::mpi_op;
using mpi::transport_type;

// ------------------------------------------------------------ collectives ---

WorkPtr MpiProcessGroup::all_reduce(const void* in, void* out, size_t count, DType t, ReduceOp op) {
  return all_reduce_with(options_.allreduce, in, out, count, t, op);
}

std::string MpiProcessGroup::choose_algorithm(size_t bytes) const {
  // Crossover points measured with `loom bench comm` on 2 and 4 ranks of one
  // machine (docs/performance.md): MPI's own algorithm for small messages,
  // the pipelined ring above.
  if (size_ <= 1) return "mpi";
  // Across hosts (2 hosts x 2 ranks over 1 and 10 Gbit/s links, the same
  // file): the hierarchical all-reduce sends each byte over the network
  // once per host instead of once per rank and wins from 128 KiB; below,
  // MPI's latency-bound algorithm is as fast or faster.
  if (spans_hosts_ && equal_nodes_ && node_size_ > 1)
    return bytes >= (size_t{128} << 10) ? "hierarchical" : "mpi";
  return bytes >= (size_t{1} << 20) ? "ring" : "mpi";
}

WorkPtr MpiProcessGroup::all_reduce_with(const std::string& algo, const void* in, void* out,
                                         size_t count, DType t, ReduceOp op) {
  LOOM_CHECK_KIND(
      kConfig,
      algo == "mpi" || algo == "ring" || algo == "rhd" || algo == "hierarchical" || algo == "auto",
      "comm.allreduce: unknown algorithm '{}' (mpi, ring, rhd, hierarchical, auto)", algo);
  LOOM_CHECK_KIND(kUnsupported, t != DType::kU8, "group '{}': bytes (u8) do not reduce", name_);
  LOOM_CHECK_KIND(kUnsupported, !(t == DType::kI64 && op == ReduceOp::kAvg),
                  "group '{}': an average of i64 counters is not an i64", name_);
  Op o{"allreduce", count, t, static_cast<int>(op)};
  if (t == DType::kF64 || t == DType::kI64) {
    // Statistics and counters: reduced exactly, by MPI, as they are.
    return enqueue(o, [this, in, out, count, t, op](Op& o) {
      o.algo = "mpi";
      o.wire = t;
      o.sent = 2.0 * (size_ - 1) / size_ * double(count * dtype_size(t));
      o.exact = false;
      MPI_Request req;
      MPI_Iallreduce(in == out ? MPI_IN_PLACE : in, out, as_int(count, "all-reduce"),
                     transport_type(t), mpi_op(op), comm_, &req);
      wait_requests(&req, 1, o);
      if (op == ReduceOp::kAvg)
        for (size_t i = 0; i < count; ++i) static_cast<double*>(out)[i] /= size_;
    });
  }
  if (t != DType::kF32 && (algo == "auto" || algo == "mpi")) {
    // 16-bit data keeps 16 bits on the wire and is reduced in f32.
    return enqueue(o, [this, in, out, count, t, op](Op& o) {
      o.algo = "direct";
      reduce_16(o, in, out, count, t, op, true);
    });
  }
  return enqueue(o, [this, algo, in, out, count, t, op](Op& o) {
    std::string a = algo == "auto" ? choose_algorithm(count * dtype_size(t)) : algo;
    // loom's algorithms reduce f32: 16-bit data travels widened through them.
    o.algo = a;
    o.wire = DType::kF32;
    // f32 works on `out` directly; bf16 and f16 on a widened f32 copy of `in`.
    F32View src(in, t, count, be_);
    float* res = t == DType::kF32 ? static_cast<float*>(out) : src.data;
    if (a == "mpi") {
      MPI_Request req;
      MPI_Iallreduce(src.data == res ? MPI_IN_PLACE : src.data, res, as_int(count, "all-reduce"),
                     MPI_FLOAT, mpi_op(op), comm_, &req);
      o.sent = 2.0 * (size_ - 1) / size_ * double(count) * sizeof(float);
      o.exact = false;
      wait_requests(&req, 1, o);
      if (op == ReduceOp::kAvg) average(res, count);
      if (t != DType::kF32) be_.round_16(res, static_cast<uint16_t*>(out), int64_t(count), t);
      return;
    }
    // loom's algorithms reduce in place.
    if (res != src.data) std::memcpy(res, src.data, count * sizeof(float));
    F32View work(res, DType::kF32, count, be_);
    auto wait = [this, &o](MPI_Request* r, int n) { wait_requests(r, n, o); };
    ReduceOp base = op == ReduceOp::kMax ? ReduceOp::kMax : ReduceOp::kSum;
    algo::P2p g{comm_, rank_, size_, wait, &o.sent};
    if (a == "ring") {
      algo::ring_all_reduce(g, work.data, count, base);
    } else if (a == "rhd") {
      algo::rhd_all_reduce(g, work.data, count, base);
    } else {
      int node_size = 0, node_rank = 0, cross_size = 0, cross_rank = 0;
      MPI_Comm_size(node_comm_, &node_size);
      MPI_Comm_rank(node_comm_, &node_rank);
      MPI_Comm_size(cross_comm_, &cross_size);
      MPI_Comm_rank(cross_comm_, &cross_rank);
      if (!equal_nodes_) {
        algo::ring_all_reduce(g, work.data, count, base);  // unequal nodes: flat ring
      } else {
        algo::hierarchical_all_reduce(algo::P2p{node_comm_, node_rank, node_size, wait, &o.sent},
                                      algo::P2p{cross_comm_, cross_rank, cross_size, wait, &o.sent},
                                      work.data, count, base);
      }
    }
    if (op == ReduceOp::kAvg) average(work.data, count);
    if (t != DType::kF32) be_.round_16(work.data, static_cast<uint16_t*>(out), int64_t(count), t);
  });
}

WorkPtr MpiProcessGroup::reduce_scatter(const void* in, void* out, size_t count, DType t,
                                        ReduceOp op) {
  LOOM_CHECK_KIND(kUnsupported, is_float_storage(t),
                  "group '{}': reduce-scatter of {} is not supported (f32, bf16, f16)", name_,
                  dtype_name(t));
  return enqueue(Op{"reducescatter", count, t, static_cast<int>(op)}, [=, this](Op& o) {
    if (t != DType::kF32) {
      reduce_16(o, in, out, count, t, op, false);
      return;
    }
    o.wire = DType::kF32;
    o.sent = double(size_ - 1) * double(count) * sizeof(float);
    o.exact = false;
    // `out` may lie inside `in` (a ZeRO unit's own slice): reduce apart.
    F32View res(count, be_);
    MPI_Request req;
    MPI_Ireduce_scatter_block(in, res.data, as_int(count, "reduce-scatter"), MPI_FLOAT, mpi_op(op),
                              comm_, &req);
    wait_requests(&req, 1, o);
    if (op == ReduceOp::kAvg) average(res.data, count);
    std::memcpy(out, res.data, count * sizeof(float));
  });
}

void MpiProcessGroup::reduce_16(Op& o, const void* in, void* out, size_t count, DType t,
                                ReduceOp op, bool all) {
  const int p = size_;
  const size_t es = dtype_size(t);
  o.wire = t;
  o.exact = true;
  // Block r of the input goes to rank r: [b_r, b_r+1) of an all-reduce's
  // `count` elements, or the r-th `count` of a reduce-scatter's input.
  std::vector<int> sc(static_cast<size_t>(p)), sd(sc.size()), rc(sc.size()), rd(sc.size());
  for (int r = 0; r < p; ++r) {
    const size_t b = all ? algo::chunk_begin(count, p, r) : count * static_cast<size_t>(r);
    const size_t e = all ? algo::chunk_begin(count, p, r + 1) : b + count;
    sc[static_cast<size_t>(r)] = as_int(e - b, "reduction block");
    sd[static_cast<size_t>(r)] = as_int(b, "reduction offset");
  }
  const size_t mine = static_cast<size_t>(sc[static_cast<size_t>(rank_)]);
  for (int r = 0; r < p; ++r) {
    rc[static_cast<size_t>(r)] = static_cast<int>(mine);
    rd[static_cast<size_t>(r)] = as_int(mine * static_cast<size_t>(r), "reduction offset");
    if (r != rank_) o.sent += double(sc[static_cast<size_t>(r)]) * double(es);
  }
  Buffer blocks(mine * static_cast<size_t>(p) * es, MemCategory::kComm, false);
  MPI_Request req;
  MPI_Ialltoallv(in, sc.data(), sd.data(), MPI_UINT16_T, blocks.data(), rc.data(), rd.data(),
                 MPI_UINT16_T, comm_, &req);
  wait_requests(&req, 1, o);
  // Every rank's block, widened, added in rank order.
  F32View wide(blocks.data(), t, mine * static_cast<size_t>(p), be_);
  float* acc = wide.data;
  for (int r = 1; r < p; ++r) {
    const float* x = wide.data + mine * static_cast<size_t>(r);
    if (op == ReduceOp::kMax)  // a NaN anywhere stays NaN
      for (size_t i = 0; i < mine; ++i) acc[i] = x[i] > acc[i] || x[i] != x[i] ? x[i] : acc[i];
    else
      be_.axpy(acc, 1.0f, x, static_cast<int64_t>(mine));
  }
  if (op == ReduceOp::kAvg) average(acc, mine);
  char* dst = static_cast<char*>(out);
  if (!all) {
    be_.round_16(acc, reinterpret_cast<uint16_t*>(dst), static_cast<int64_t>(mine), t);
    return;
  }
  be_.round_16(
      acc,
      reinterpret_cast<uint16_t*>(dst + static_cast<size_t>(sd[static_cast<size_t>(rank_)]) * es),
      static_cast<int64_t>(mine), t);
  o.sent += double(p - 1) * double(mine) * double(es);
  MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, out, sc.data(), sd.data(), MPI_UINT16_T,
                  comm_, &req);
  wait_requests(&req, 1, o);
}

WorkPtr MpiProcessGroup::all_gather(const void* in, void* out, size_t count, DType t) {
  return enqueue(Op{"allgather", count, t, 0}, [=, this](Op& o) {
    const size_t bytes = count * dtype_size(t);
    o.wire = t;
    o.sent = double(size_ - 1) * double(bytes);
    o.exact = false;
    char* dst = static_cast<char*>(out);
    char* mine = dst + static_cast<size_t>(rank_) * bytes;
    // An input inside the output but not at this rank's block (in == out on
    // ranks above 0) would be overwritten by the others' blocks as MPI
    // writes them: move it to its block first and gather in place.
    const char* src = static_cast<const char*>(in);
    if (src != mine && src + bytes > dst && src < dst + static_cast<size_t>(size_) * bytes) {
      std::memmove(mine, src, bytes);
      src = mine;
    }
    const bool in_place = src == mine;
    const int n = as_int(count, "all-gather");
    MPI_Request req;
    MPI_Iallgather(in_place ? MPI_IN_PLACE : src, n, transport_type(t), out, n, transport_type(t),
                   comm_, &req);
    wait_requests(&req, 1, o);
  });
}

WorkPtr MpiProcessGroup::broadcast(void* buf, size_t count, DType t, int root) {
  LOOM_CHECK(root >= 0 && root < size_, "broadcast root {} outside group '{}' of size {}", root,
             name_, size_);
  return enqueue(Op{"broadcast", count, t, root}, [=, this](Op& o) {
    o.wire = t;
    o.sent = double(size_ - 1) / size_ * double(count * dtype_size(t));
    o.exact = false;
    MPI_Request req;
    MPI_Ibcast(buf, as_int(count, "broadcast"), transport_type(t), root, comm_, &req);
    wait_requests(&req, 1, o);
  });
}

WorkPtr MpiProcessGroup::all_to_all(const void* in, const std::vector<size_t>& send_counts,
                                    void* out, const std::vector<size_t>& recv_counts, DType t) {
  LOOM_CHECK(send_counts.size() == static_cast<size_t>(size_) &&
                 recv_counts.size() == static_cast<size_t>(size_),
             "all-to-all needs {} send and receive counts, got {} and {}", size_,
             send_counts.size(), recv_counts.size());
  size_t total = 0;
  for (size_t c : send_counts) total += c;
  return enqueue(Op{"alltoall", total, t, 0}, [=, this](Op& o) {
    o.wire = t;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) o.sent += double(send_counts[static_cast<size_t>(r)] * dtype_size(t));
    std::vector<int> sc(static_cast<size_t>(size_)), sd(sc.size()), rc(sc.size()), rd(sc.size());
    size_t so = 0, ro = 0;
    for (int r = 0; r < size_; ++r) {
      sc[r] = as_int(send_counts[r], "all-to-all"), sd[r] = as_int(so, "all-to-all offset");
      rc[r] = as_int(recv_counts[r], "all-to-all"), rd[r] = as_int(ro, "all-to-all offset");
      so += send_counts[r], ro += recv_counts[r];
    }
    // In place: MPI needs distinct buffers, so send from a copy.
    Buffer copy;
    const void* src = in;
    if (in == out) {
      copy = Buffer(so * dtype_size(t), MemCategory::kComm);
      std::memcpy(copy.data(), in, so * dtype_size(t));
      src = copy.data();
    }
    MPI_Request req;
    MPI_Ialltoallv(src, sc.data(), sd.data(), transport_type(t), out, rc.data(), rd.data(),
                   transport_type(t), comm_, &req);
    wait_requests(&req, 1, o);
  });
}

WorkPtr MpiProcessGroup::send(const void* buf, size_t count, DType t, int peer, int tag,
                              const std::string& what) {
  LOOM_CHECK(tag >= 0 && tag < algo::kAlgoTagBase, "tag {} outside [0, {})", tag,
             algo::kAlgoTagBase);
  const int n = as_int(count, "send");
  return enqueue_p2p(Op{"send", count, t, peer, 0, what}, [=, this](MPI_Request* req) {
    MPI_Isend(buf, n, transport_type(t), peer, tag, comm_, req);
  });
}

WorkPtr MpiProcessGroup::recv(void* buf, size_t count, DType t, int peer, int tag,
                              const std::string& what) {
  LOOM_CHECK(tag >= 0 && tag < algo::kAlgoTagBase, "tag {} outside [0, {})", tag,
             algo::kAlgoTagBase);
  const int n = as_int(count, "recv");
  return enqueue_p2p(Op{"recv", count, t, peer, 0, what}, [=, this](MPI_Request* req) {
    MPI_Irecv(buf, n, transport_type(t), peer, tag, comm_, req);
  });
}

WorkPtr MpiProcessGroup::barrier() {
  return enqueue(Op{"barrier", 0, DType::kF32, 0}, [=, this](Op& o) {
    MPI_Request req;
    MPI_Ibarrier(comm_, &req);
    wait_requests(&req, 1, o);
  });
}

}  // namespace loom
