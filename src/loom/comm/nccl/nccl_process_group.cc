#include "loom/comm/nccl/nccl_process_group.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <numeric>
#include <thread>

#include "loom/comm/record.h"
#include "loom/core/error.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kU8:
      return ncclUint8;
    case DType::kF64:
      return ncclFloat64;
    case DType::kI64:
      return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

std::string nccl_error(ncclResult_t r) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') s += std::string(": ") + last;
  return s;
}

void cuda_check(cudaError_t e, const char* what) {
  LOOM_CHECK_KIND(kComm, e == cudaSuccess, "NCCL group: {} failed: {}", what,
                  cudaGetErrorString(e));
}

}  // namespace

// An operation queued on the group's stream, until the watchdog sees it end.
struct Pending {
  cudaEvent_t event;
  Clock::time_point deadline;
  std::string what;
  CommEvent record;
};

struct NcclProcessGroup::State {
  ncclComm_t comm = nullptr;  // null once aborted
  cudaStream_t stream = nullptr;
  int device = 0, rank = 0, size = 1;
  std::string name;
  double timeout_s = 600;
  CommRecord* record = nullptr;
  std::mutex mu;          // issuing operations (one at a time on the stream)
  std::mutex pending_mu;  // the pending queue, shared with the watchdog
  std::deque<Pending> pending;
  std::mutex fail_mu;
  std::atomic<bool> failed{false};
  std::string failure;  // set once, before `failed`
  std::atomic<bool> stop{false};
  std::thread watchdog;

  // Aborts the communicator and ends the job with `message` (once).
  void fail(const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(fail_mu);
      if (failed.load()) return;
      failure = message;
      failed = true;
      if (comm != nullptr) ncclCommAbort(comm);
      comm = nullptr;
    }
    fail_fast(message);
  }

  // Waits until the non-blocking communicator has settled the last call.
  ncclResult_t settle(ncclResult_t r, Clock::time_point deadline) {
    while (r == ncclInProgress) {
      if (failed.load()) return ncclInternalError;
      if (Clock::now() > deadline) return ncclInProgress;
      std::this_thread::yield();
      std::lock_guard<std::mutex> lock(fail_mu);
      if (comm == nullptr) return ncclInternalError;
      ncclCommGetAsyncError(comm, &r);
    }
    return r;
  }

  void watch() {
    cudaSetDevice(device);  // this thread's queries on the group's GPU
    while (!stop.load()) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (failed.load()) continue;
      ncclResult_t async = ncclSuccess;
      {
        std::lock_guard<std::mutex> lock(fail_mu);
        if (comm != nullptr) ncclCommGetAsyncError(comm, &async);
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        fail(format("NCCL group '{}' rank {} of {}: NCCL reports {}", name, rank, size,
                    nccl_error(async)));
        continue;
      }
      std::string timed_out;
      {
        std::lock_guard<std::mutex> lock(pending_mu);
        while (!pending.empty()) {
          Pending& p = pending.front();
          const cudaError_t q = cudaEventQuery(p.event);
          if (q == cudaErrorNotReady) {
            if (Clock::now() > p.deadline)
              timed_out = format(
                  "comm timeout: NCCL group '{}' rank {} of {}: {} did not complete "
                  "within {} s (comm.timeout_s); the communicator is aborted",
                  name, rank, size, p.what, timeout_s);
            break;
          }
          p.record.ended = comm_clock();
          p.record.failed = q != cudaSuccess;
          if (record != nullptr) record->add(p.record);
          cudaEventDestroy(p.event);
          pending.pop_front();
        }
      }
      if (!timed_out.empty()) fail(timed_out);
    }
  }
};

namespace {

// The device completion of one operation; waits give up when the group
// has failed (its communicator aborted).
class NcclEvent final : public DeviceEvent {
 public:
  NcclEvent(cudaEvent_t e, std::shared_ptr<const NcclProcessGroup::State> s)
      : e_(e), s_(std::move(s)) {}
  ~NcclEvent() override { cudaEventDestroy(e_); }
  Device device() const override { return Device::kCuda; }
  bool query() const override { return cudaEventQuery(e_) == cudaSuccess; }
  void synchronize() const override {
    for (;;) {
      const cudaError_t q = cudaEventQuery(e_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady)
        LOOM_FAIL(kComm, "NCCL group '{}': an operation failed on the device: {}", s_->name,
                  cudaGetErrorString(q));
      if (s_->failed.load()) LOOM_FAIL(kComm, "{}", s_->failure);
      std::this_thread::yield();
    }
  }

 private:
  cudaEvent_t e_;
  std::shared_ptr<const NcclProcessGroup::State> s_;
};

// A caller's buffer as NCCL takes it: device and managed memory in place,
// registered host memory by its device alias, plain host memory copied.
struct Staged {
  void* host = nullptr;
  void* dev = nullptr;
  size_t bytes = 0;
  bool written = false;
};
void* device_usable(void* p, size_t bytes, bool written, cudaStream_t stream,
                    std::vector<Staged>& staged) {
  if (p == nullptr || bytes == 0) return p;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    a.type = cudaMemoryTypeUnregistered;
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return p;
  if (a.type == cudaMemoryTypeHost && a.devicePointer != nullptr) return a.devicePointer;
  for (Staged& s : staged)
    if (s.host == p && s.bytes >= bytes) {
      s.written = s.written || written;
      return s.dev;
    }
  Staged s{p, nullptr, bytes, written};
  cuda_check(cudaMallocAsync(&s.dev, bytes, stream), "cudaMallocAsync");
  cuda_check(cudaMemcpyAsync(s.dev, p, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  staged.push_back(s);
  return s.dev;
}

struct Buf {
  const void* p;
  size_t bytes;
  bool written;
};

}  // namespace

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

std::shared_ptr<NcclProcessGroup> NcclProcessGroup::create(ProcessGroup& bootstrap,
                                                           std::string name, int device,
                                                           double timeout_s, CommRecord* record) {
  auto s = std::make_shared<State>();
  s->device = device;
  s->rank = bootstrap.rank();
  s->size = bootstrap.size();
  s->name = std::move(name);
  s->timeout_s = timeout_s;
  s->record = record;
  ncclUniqueId id{};
  ncclResult_t r = ncclSuccess;
  if (s->rank == 0) r = ncclGetUniqueId(&id);
  // Every member learns whether rank 0 made an id (else all throw alike).
  uint8_t ok = r == ncclSuccess ? 1 : 0;
  bootstrap.broadcast(&ok, 1, DType::kU8, 0)->wait();
  LOOM_CHECK_KIND(kComm, ok == 1,
                  "NCCL failed to initialise group '{}': rank 0 could not make "
                  "the unique id{}",
                  s->name, s->rank == 0 ? ": " + nccl_error(r) : "");
  bootstrap.broadcast(&id, sizeof(id), DType::kU8, 0)->wait();
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
  cuda_check(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking), "cudaStreamCreate");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(std::min(timeout_s, 1e9)));
  r = ncclCommInitRankConfig(&s->comm, s->size, id, s->rank, &config);
  if (r == ncclSuccess || r == ncclInProgress) r = s->settle(ncclInProgress, deadline);
  if (r != ncclSuccess) {
    const std::string why =
        r == ncclInProgress ? format("it did not finish within {} s (comm.timeout_s)", timeout_s)
                            : nccl_error(r);
    if (s->comm != nullptr) ncclCommAbort(s->comm);
    cudaStreamDestroy(s->stream);
    LOOM_FAIL(kComm, "NCCL failed to initialise group '{}' (rank {} of {}, GPU {}): {}", s->name,
              s->rank, s->size, device, why);
  }
  State* raw = s.get();
  s->watchdog = std::thread([raw] { raw->watch(); });
  return std::shared_ptr<NcclProcessGroup>(new NcclProcessGroup(std::move(s)));
}

NcclProcessGroup::NcclProcessGroup(std::shared_ptr<State> s) : s_(std::move(s)) {}

NcclProcessGroup::~NcclProcessGroup() {
  if (!s_->failed.load()) cudaStreamSynchronize(s_->stream);
  s_->stop = true;
  if (s_->watchdog.joinable()) s_->watchdog.join();
  for (Pending& p : s_->pending) cudaEventDestroy(p.event);
  s_->pending.clear();
  if (s_->comm != nullptr) ncclCommDestroy(s_->comm);  // null: aborted already
  s_->comm = nullptr;
  cudaStreamDestroy(s_->stream);
}

int NcclProcessGroup::rank() const {
  return s_->rank;
}
int NcclProcessGroup::size() const {
  return s_->size;
}
const std::string& NcclProcessGroup::name() const {
  return s_->name;
}
CommRecord* NcclProcessGroup::record() const {
  return s_->record;
}

namespace {

// Queues `op` on the group's stream with its buffers made device-usable;
// returns the Work (completing on the device, or before returning when a
// buffer was staged).
template <typename Op>
WorkPtr issue(const std::shared_ptr<NcclProcessGroup::State>& sp, const std::string& what,
              CommEvent ev, const std::vector<Buf>& bufs, Op op) {
  NcclProcessGroup::State& s = *sp;
  auto work = std::make_shared<Work>(what, s.timeout_s);
  ev.enqueued = comm_clock();
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.failed.load()) {
    work->fail(s.failure);
    return work;
  }
  cuda_check(cudaSetDevice(s.device), "cudaSetDevice");
  std::vector<Staged> staged;
  std::vector<void*> dev;
  auto free_staged = [&] {
    for (const Staged& b : staged) cudaFreeAsync(b.dev, s.stream);
  };
  for (const Buf& b : bufs)
    dev.push_back(device_usable(const_cast<void*>(b.p), b.bytes, b.written, s.stream, staged));
  work->mark_started();
  ev.started = comm_clock();
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::min(s.timeout_s, 1e9)));
  ncclComm_t comm;
  {
    std::lock_guard<std::mutex> f(s.fail_mu);
    comm = s.comm;
  }
  ncclResult_t r = comm != nullptr ? op(dev, comm, s.stream) : ncclInternalError;
  r = s.settle(r, deadline);
  if (r != ncclSuccess) {
    const std::string msg =
        s.failed.load()
            ? s.failure
            : format("NCCL group '{}' rank {} of {}: {} failed: {}", s.name, s.rank, s.size, what,
                     r == ncclInProgress ? "it was not enqueued within comm.timeout_s"
                                         : nccl_error(r));
    free_staged();
    lock.unlock();
    s.fail(msg);
    work->fail(msg);
    return work;
  }
  // Two events: the Work's, and the watchdog's (deadline and record).
  cudaEvent_t e, watched;
  cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  cuda_check(cudaEventCreateWithFlags(&watched, cudaEventDisableTiming), "cudaEventCreate");
  cuda_check(cudaEventRecord(e, s.stream), "cudaEventRecord");
  cuda_check(cudaEventRecord(watched, s.stream), "cudaEventRecord");
  {
    std::lock_guard<std::mutex> p(s.pending_mu);
    s.pending.push_back({watched, deadline, what, ev});
  }
  auto done = std::make_shared<NcclEvent>(e, sp);
  if (staged.empty()) {
    work->set_event(std::move(done));
    work->finish(0);
    return work;
  }
  // A host buffer: wait here (the watchdog enforces the deadline and ends
  // the wait by failing the group), copy the results back, free the copies.
  lock.unlock();
  try {
    done->synchronize();
  } catch (const Error& err) {
    work->fail(err.what());
    return work;  // the copies stay: the aborted communicator may still hold them
  }
  for (const Staged& b : staged)
    if (b.written)
      cuda_check(cudaMemcpy(b.host, b.dev, b.bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  for (const Staged& b : staged) cudaFreeAsync(b.dev, s.stream);
  work->finish(comm_clock() - ev.started);
  return work;
}

CommEvent event_of(const NcclProcessGroup::State& s, const char* kind, DType t, size_t count,
                   double sent, bool exact, int peer = -1) {
  CommEvent e;
  e.group = s.name;
  e.kind = kind;
  e.algo = "nccl";
  e.dtype = e.wire = t;
  e.count = count;
  e.peer = peer;
  e.sent_bytes = sent;
  e.exact = exact;
  return e;
}

std::string describe(const NcclProcessGroup::State& s, const char* kind, size_t count, DType t) {
  return format("{} of {} {} on group '{}'", kind, count, dtype_name(t), s.name);
}

}  // namespace

WorkPtr NcclProcessGroup::all_reduce(const void* in, void* out, size_t count, DType t,
                                     ReduceOp op) {
  const size_t bytes = count * dtype_size(t);
  const double p = s_->size;
  return issue(s_, describe(*s_, "all-reduce", count, t),
               event_of(*s_, "allreduce", t, count, 2 * (p - 1) / p * double(bytes), false),
               {{in, bytes, false}, {out, bytes, true}},
               [&](const std::vector<void*>& d, ncclComm_t c, cudaStream_t st) {
                 return ncclAllReduce(d[0], d[1], count, nccl_type(t), nccl_op(op), c, st);
               });
}

WorkPtr NcclProcessGroup::reduce_scatter(const void* in, void* out, size_t count, DType t,
                                         ReduceOp op) {
  const size_t bytes = count * dtype_size(t);
  const double p = s_->size;
  return issue(s_, describe(*s_, "reduce-scatter", count, t),
               event_of(*s_, "reducescatter", t, count, (p - 1) * double(bytes), false),
               {{in, bytes * static_cast<size_t>(s_->size), false}, {out, bytes, true}},
               [&](const std::vector<void*>& d, ncclComm_t c, cudaStream_t st) {
                 return ncclReduceScatter(d[0], d[1], count, nccl_type(t), nccl_op(op), c, st);
               });
}

WorkPtr NcclProcessGroup::all_gather(const void* in, void* out, size_t count, DType t) {
  const size_t bytes = count * dtype_size(t);
  const double p = s_->size;
  return issue(s_, describe(*s_, "all-gather", count, t),
               event_of(*s_, "allgather", t, count, (p - 1) * double(bytes), false),
               {{in, bytes, false}, {out, bytes * static_cast<size_t>(s_->size), true}},
               [&](const std::vector<void*>& d, ncclComm_t c, cudaStream_t st) {
                 return ncclAllGather(d[0], d[1], count, nccl_type(t), c, st);
               });
}

WorkPtr NcclProcessGroup::broadcast(void* buf, size_t count, DType t, int root) {
  const size_t bytes = count * dtype_size(t);
  const double p = s_->size;
  return issue(s_, describe(*s_, "broadcast", count, t),
               event_of(*s_, "broadcast", t, count, (p - 1) / p * double(bytes), false),
               {{buf, bytes, true}},
               [&](const std::vector<void*>& d, ncclComm_t c, cudaStream_t st) {
                 return ncclBroadcast(d[0], d[0], count, nccl_type(t), root, c, st);
               });
}

WorkPtr NcclProcessGroup::all_to_all(const void* in, const std::vector<size_t>& send_counts,
                                     void* out, const std::vector<size_t>& recv_counts, DType t) {
  const size_t n = static_cast<size_t>(s_->size), es = dtype_size(t);
  LOOM_CHECK(send_counts.size() == n && recv_counts.size() == n,
             "all-to-all on group '{}' of {} ranks with {} send and {} receive counts", s_->name, n,
             send_counts.size(), recv_counts.size());
  const size_t sends = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
  const size_t recvs = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
  double sent = 0;
  for (size_t r = 0; r < n; ++r)
    if (static_cast<int>(r) != s_->rank) sent += double(send_counts[r] * es);
  return issue(s_, describe(*s_, "all-to-all", sends, t),
               event_of(*s_, "alltoall", t, sends, sent, true),
               {{in, sends * es, false}, {out, recvs * es, true}},
               [&](const std::vector<void*>& d, ncclComm_t c, cudaStream_t st) {
                 ncclResult_t r = ncclGroupStart();
                 size_t so = 0, ro = 0;
                 for (size_t k = 0; k < n && r == ncclSuccess; ++k) {
                   const int peer = static_cast<int>(k);
                   if (send_counts[k] > 0)
                     r = ncclSend(static_cast<const char*>(d[0]) + so * es, send_counts[k],
                                  nccl_type(t), peer, c, st);
                   if (r == ncclSuccess && recv_counts[k] > 0)
                     r = ncclRecv(static_cast<char*>(d[1]) + ro * es, recv_counts[k], nccl_type(t),
                                  peer, c, st);
                   so += send_counts[k];
                   ro += recv_counts[k];
                 }
                 const ncclResult_t end = ncclGroupEnd();
                 return r != ncclSuccess ? r : end;
               });
}

WorkPtr NcclProcessGroup::send(const void* buf, size_t count, DType t, int peer, int tag,
                               const std::string& what) {
  const size_t bytes = count * dtype_size(t);
  const std::string w = what.empty() ? format("send of {} {} to rank {} (tag {}) on group '{}'",
                                              count, dtype_name(t), peer, tag, s_->name)
                                     : what;
  return issue(s_, w, event_of(*s_, "send", t, count, double(bytes), true, peer),
               {{buf, bytes, false}},
               [&](const std::vector<void*>& d, ncclComm_t c, cudaStream_t st) {
                 return ncclSend(d[0], count, nccl_type(t), peer, c, st);
               });
}

WorkPtr NcclProcessGroup::recv(void* buf, size_t count, DType t, int peer, int tag,
                               const std::string& what) {
  const size_t bytes = count * dtype_size(t);
  const std::string w = what.empty()
                            ? format("receive of {} {} from rank {} (tag {}) on group '{}'", count,
                                     dtype_name(t), peer, tag, s_->name)
                            : what;
  return issue(s_, w, event_of(*s_, "recv", t, count, 0, true, peer), {{buf, bytes, true}},
               [&](const std::vector<void*>& d, ncclComm_t c, cudaStream_t st) {
                 return ncclRecv(d[0], count, nccl_type(t), peer, c, st);
               });
}

WorkPtr NcclProcessGroup::barrier() {
  // An all-reduce of one value on the device: complete when every rank came.
  void* one = nullptr;
  cuda_check(cudaMallocAsync(&one, sizeof(float), s_->stream), "cudaMallocAsync");
  cuda_check(cudaMemsetAsync(one, 0, sizeof(float), s_->stream), "cudaMemsetAsync");
  WorkPtr w = issue(s_, format("barrier on group '{}'", s_->name),
                    event_of(*s_, "barrier", DType::kF32, 1, 0, true), {{one, sizeof(float), true}},
                    [&](const std::vector<void*>& d, ncclComm_t c, cudaStream_t st) {
                      return ncclAllReduce(d[0], d[0], 1, ncclFloat32, ncclSum, c, st);
                    });
  cudaFreeAsync(one, s_->stream);
  return w;
}

}  // namespace loom
