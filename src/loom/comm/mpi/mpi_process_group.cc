#include "loom/comm/mpi/mpi_process_group.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "loom/comm/algorithms/allreduce.h"
#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/core/threads.h"

namespace loom {

namespace {

constexpr int kQueryTag = 1, kReplyTagBase = 1000;
using Clock = std::chrono::steady_clock;

// Operation names by the code the debug-mode descriptors carry.
constexpr const char* kKinds[] = {"allreduce", "reducescatter", "allgather", "broadcast",
                                  "alltoall",  "barrier",       "send",      "recv"};
constexpr int kNumKinds = 8;

int kind_code(const std::string& kind) {
  for (int i = 0; i < kNumKinds; ++i)
    if (kind == kKinds[i]) return i;
  return -1;
}

}  // namespace

// ---------------------------------------------------------------- runtime ---

namespace {
// The process's one runtime, for the fatal and terminate handlers (which
// are plain functions).
std::atomic<MpiRuntime*> g_runtime{nullptr};

void fatal_from_library(const std::string& message) {
  if (MpiRuntime* rt = g_runtime.load()) rt->abort(message);
}

[[noreturn]] void on_terminate() {
  std::string what = "std::terminate called";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = format("std::terminate called after an uncaught exception: {}", x.what());
    } catch (...) {
      what = "std::terminate called after an uncaught exception of unknown type";
    }
  }
  if (MpiRuntime* rt = g_runtime.load()) rt->abort(what);
  std::fprintf(stderr, "loom: %s\n", what.c_str());
  std::abort();
}
}  // namespace

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  // Without a launcher MPI starts a singleton; isolated, it needs no helper
  // daemon (and starts in a fraction of the time). Launched jobs ignore it.
  setenv("OMPI_MCA_ess_singleton_isolated", "1", 0);
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
  if (provided < MPI_THREAD_MULTIPLE)
    abort(format("this MPI library provides thread level {} but loom needs MPI_THREAD_MULTIPLE",
                 provided));
  MPI_Comm_dup(MPI_COMM_WORLD, &control_);
  discover_topology();
  g_runtime = this;
  if (world_size_ > 1) {
    // Library code that would otherwise wait on peers while an error
    // unwinds ends the job instead, and so does an exception nobody caught.
    set_fatal_handler(fatal_from_library);
    std::set_terminate(on_terminate);
  }
  watchdog_ = std::thread([this] { serve_queries(); });
}

MpiRuntime::~MpiRuntime() {
  stop_ = true;
  watchdog_.join();
  set_fatal_handler(nullptr);
  g_runtime = nullptr;
  MPI_Barrier(control_);
  MPI_Comm_free(&control_);
  MPI_Finalize();
}

// The hosts of the job: MPI's shared-memory split says which ranks share a
// host (a host is identified by its lowest rank), the processor name of that
// rank names it. Collective over the world, once, at start.
void MpiRuntime::discover_topology() {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank_, MPI_INFO_NULL, &node);
  MPI_Comm_size(node, &node_size_);
  int leader = world_rank_;
  MPI_Bcast(&leader, 1, MPI_INT, 0, node);  // node rank 0 is the lowest world rank (key)
  MPI_Comm_free(&node);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  const auto n = static_cast<size_t>(world_size_);
  std::vector<int> leaders(n);
  std::vector<char> names(n * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, MPI_COMM_WORLD);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME,
                MPI_CHAR, MPI_COMM_WORLD);
  topology_.host_of.assign(n, -1);
  std::vector<int> host_of_leader(n, -1);
  for (size_t r = 0; r < n; ++r) {
    auto l = static_cast<size_t>(leaders[r]);
    if (host_of_leader[l] < 0) {
      host_of_leader[l] = topology_.hosts();
      topology_.names.emplace_back(&names[l * MPI_MAX_PROCESSOR_NAME]);
    }
    topology_.host_of[r] = host_of_leader[l];
  }
}

std::shared_ptr<MpiProcessGroup> MpiRuntime::world(const CommOptions& options) {
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  return std::make_shared<MpiProcessGroup>(this, comm, "world", options);
}

void MpiRuntime::abort(const std::string& message, int code) {
  // One report per rank: a second thread failing at the same time (the
  // communication worker, the watchdog) waits for the first to end the job.
  static std::atomic<bool> aborting{false};
  if (aborting.exchange(true))
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  std::fprintf(stderr, "loom: rank %d: %s\n", world_rank_, message.c_str());
  std::fflush(stderr);
  // MPI_Abort can block when the launcher is out of reach (a partitioned
  // host): after a grace period this rank ends itself, so no rank outlives
  // its report.
  std::thread([rank = world_rank_, code] {
    std::this_thread::sleep_for(std::chrono::duration<double>(kAbortGraceS));
    std::fprintf(stderr,
                 "loom: rank %d: MPI_Abort did not end the job within %.0f s (launcher out of "
                 "reach?); this rank exits on its own\n",
                 rank, kAbortGraceS);
    std::fflush(stderr);
    std::_Exit(code);
  }).detach();
  // mpirun relays a rank's stderr asynchronously and tears the job down on
  // the first abort: give the line a moment to get out (two ranks timing out
  // at once otherwise lost it in a test).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void MpiRuntime::register_group(MpiProcessGroup* g) {
  std::lock_guard<std::mutex> lock(groups_mu_);
  g->id_ = next_group_id_++;
  groups_.push_back(g);
}

void MpiRuntime::unregister_group(MpiProcessGroup* g) {
  std::lock_guard<std::mutex> lock(groups_mu_);
  groups_.erase(std::remove(groups_.begin(), groups_.end(), g), groups_.end());
}

// Answers "how many operations has your group <id> started?" from other
// ranks whose operation timed out.
void MpiRuntime::serve_queries() {
  while (!stop_) {
    int flag = 0;
    MPI_Status st;
    MPI_Iprobe(MPI_ANY_SOURCE, kQueryTag, control_, &flag, &st);
    if (!flag) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    int id = -1;
    MPI_Recv(&id, 1, MPI_INT, st.MPI_SOURCE, kQueryTag, control_, MPI_STATUS_IGNORE);
    uint64_t started = 0;
    {
      std::lock_guard<std::mutex> lock(groups_mu_);
      for (MpiProcessGroup* g : groups_)
        if (g->id() == id) started = g->started();
    }
    MPI_Send(&started, 1, MPI_UINT64_T, st.MPI_SOURCE, kReplyTagBase + id, control_);
  }
}

// ------------------------------------------------------------------ group ---

MpiProcessGroup::MpiProcessGroup(MpiRuntime* runtime, MPI_Comm comm, std::string name,
                                 CommOptions options)
    : runtime_(runtime), comm_(comm), name_(std::move(name)), options_(std::move(options)) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  MPI_Group mine, world;
  MPI_Comm_group(comm_, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> local(static_cast<size_t>(size_));
  for (int i = 0; i < size_; ++i) local[i] = i;
  members_.resize(static_cast<size_t>(size_));
  MPI_Group_translate_ranks(mine, size_, local.data(), world, members_.data());
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
  // Nodes: the hosts (MPI's shared-memory split); with comm.ranks_per_node,
  // blocks of that many of this group's ranks inside each host, to emulate
  // smaller nodes (never one spanning hosts).
  MPI_Comm host_comm;
  MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &host_comm);
  int host_rank = 0, host_size = 0;
  MPI_Comm_rank(host_comm, &host_rank);
  MPI_Comm_size(host_comm, &host_size);
  spans_hosts_ = host_size < size_;
  if (options_.ranks_per_node > 0) {
    MPI_Comm_split(host_comm, host_rank / options_.ranks_per_node, rank_, &node_comm_);
    MPI_Comm_free(&host_comm);
  } else {
    node_comm_ = host_comm;
  }
  int local_rank = 0;
  MPI_Comm_rank(node_comm_, &local_rank);
  MPI_Comm_split(comm_, local_rank, rank_, &cross_comm_);
  // The hierarchical all-reduce needs nodes of one size; every member must
  // reach the same verdict, so it is agreed on here, once.
  MPI_Comm_size(node_comm_, &node_size_);
  int range[2] = {node_size_, -node_size_};
  MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_INT, MPI_MAX, comm_);
  equal_nodes_ = range[0] == -range[1];
  runtime_->register_group(this);
  worker_ = std::thread([this] { run_worker(); });
}

MpiProcessGroup::~MpiProcessGroup() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // What the destroying thread is unwinding from, for the worker's report.
    abandon_cause_ = last_error();
    stop_ = true;
  }
  abandoned_ = true;
  cv_.notify_all();
  worker_.join();
  runtime_->unregister_group(this);
  MPI_Comm_free(&node_comm_);
  MPI_Comm_free(&cross_comm_);
  MPI_Comm_free(&comm_);
}

std::shared_ptr<MpiProcessGroup> MpiProcessGroup::split(const std::vector<std::vector<int>>& groups,
                                                        const std::string& name) {
  int color = -1, key = 0;
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t k = 0; k < groups[g].size(); ++k)
      if (groups[g][k] == rank_) color = static_cast<int>(g), key = static_cast<int>(k);
  // MPI_Comm_split is a collective on comm_: it runs on the worker, in queue
  // order with this group's other collectives. A rank in none of the groups
  // (a middle pipeline stage and the embedding groups) takes part and gets none.
  MPI_Comm comm = MPI_COMM_NULL;
  enqueue(Op{"split", groups.size(), DType::kF32, 0}, [&](Op&) {
    MPI_Comm_split(comm_, color >= 0 ? color : MPI_UNDEFINED, key, &comm);
  })->wait();
  if (comm == MPI_COMM_NULL) return nullptr;
  return std::make_shared<MpiProcessGroup>(runtime_, comm, name, options_);
}

std::string MpiProcessGroup::Op::describe() const {
  std::string s = format("{} #{} ({} x {}", kind, seq, count, dtype_name(dtype));
  if (kind == "allreduce" || kind == "reducescatter")
    s += format(", {}", reduce_op_name(static_cast<ReduceOp>(arg)));
  if (kind == "broadcast") s += format(", root {}", arg);
  if (kind == "send" || kind == "recv") s += format(", peer {}", arg);
  return s + ")";
}

void MpiProcessGroup::add_record(const Op& op, double started, bool failed) {
  if (runtime_ == nullptr || op.kind == "split") return;
  CommEvent e;
  e.group = name_;
  e.kind = op.kind;
  e.algo = op.algo;
  e.dtype = op.dtype;
  e.wire = op.wire;
  e.count = op.count;
  if (op.kind == "send" || op.kind == "recv") e.peer = op.arg;
  e.sent_bytes = op.sent;
  e.exact = op.exact;
  e.failed = failed;
  e.enqueued = op.enqueued;
  e.started = started;
  e.ended = comm_clock();
  runtime_->record().add(std::move(e));
}

WorkPtr MpiProcessGroup::enqueue(Op op, std::function<void(Op&)> body) {
  op.seq = ++next_seq_;
  op.enqueued = comm_clock();
  auto work =
      std::make_shared<Work>(format("{} in group '{}'", op.describe(), name_), options_.timeout_s);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({work, [this, op, body = std::move(body), work]() mutable {
                        started_ = op.seq;
                        work->mark_started();
                        auto t0 = Clock::now();
                        const double started = comm_clock();
                        try {
                          if (options_.debug && op.kind != "send" && op.kind != "recv")
                            check_descriptors(op);
                          body(op);
                          add_record(op, started);
                          work->finish(seconds_since(t0));
                        } catch (const Error& e) {
                          add_record(op, started, true);
                          work->fail(format("group '{}' rank {}: {}: {}", name_, rank_,
                                            op.describe(), e.what()));
                        } catch (const std::exception& e) {
                          // Anything else (std::bad_alloc in an algorithm's buffers) fails the
                          // operation too: an exception leaving the worker would terminate the
                          // process and leave the waiting side blocked.
                          add_record(op, started, true);
                          work->fail(format("group '{}' rank {}: {}: {}", name_, rank_,
                                            op.describe(), e.what()));
                        } catch (...) {
                          add_record(op, started, true);
                          work->fail(format("group '{}' rank {}: {}: unknown exception", name_,
                                            rank_, op.describe()));
                        }
                      }});
  }
  cv_.notify_one();
  return work;
}

WorkPtr MpiProcessGroup::enqueue_p2p(Op op, std::function<void(MPI_Request*)> post) {
  // Numbered apart from the collectives: only two members take part, so they
  // must not shift the collectives' positions that debug mode and the
  // watchdog compare across the group.
  op.seq = ++next_p2p_seq_;
  op.enqueued = comm_clock();
  op.wire = op.dtype;
  if (op.kind == "send") op.sent = static_cast<double>(op.count * dtype_size(op.dtype));
  auto work = std::make_shared<Work>(
      format("{}{}{} in group '{}'", op.what, op.what.empty() ? "" : ": ", op.describe(), name_),
      options_.timeout_s);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({work, [this, op, post = std::move(post), work] {
                        work->mark_started();
                        PendingP2p p{MPI_REQUEST_NULL, work, op, Clock::now(), comm_clock()};
                        post(&p.req);
                        p2p_.push_back(std::move(p));
                        poll_p2p();
                      }});
  }
  cv_.notify_one();
  return work;
}

void MpiProcessGroup::poll_p2p() {
  for (size_t i = 0; i < p2p_.size();) {
    int done = 0;
    MPI_Test(&p2p_[i].req, &done, MPI_STATUS_IGNORE);
    if (done) {
      add_record(p2p_[i].op, p2p_[i].started);
      p2p_[i].work->finish(seconds_since(p2p_[i].start));
      p2p_.erase(p2p_.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    if (seconds_since(p2p_[i].start) > options_.timeout_s) timed_out(p2p_[i].op);
    ++i;
  }
}

void MpiProcessGroup::run_worker() {
  // The worker's conversions and sums run on the backend beside the rank's
  // compute threads, not with a team of their own.
  run_this_thread_serially();
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // With requests in flight, wake up regularly to complete them.
      if (p2p_.empty())
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      else
        cv_.wait_for(lock, std::chrono::microseconds(50),
                     [this] { return stop_ || !queue_.empty(); });
      if (stop_) {
        // The group is being destroyed: whatever is still queued or in
        // flight was abandoned by its caller (an error unwound past it).
        // Waiting for it would mean waiting on peers that may wait on us.
        for (Task& t : queue_)
          t.work->fail(
              format("group '{}' rank {}: abandoned: the group was destroyed before "
                     "the operation ran",
                     name_, rank_));
        queue_.clear();
        lock.unlock();
        cancel_p2p();
        return;
      }
      if (queue_.empty()) {
        lock.unlock();
        poll_p2p();
        continue;
      }
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task.run();
  }
}

void MpiProcessGroup::cancel_p2p() {
  for (PendingP2p& p : p2p_) {
    int done = 0;
    MPI_Test(&p.req, &done, MPI_STATUS_IGNORE);
    if (done) {
      add_record(p.op, p.started);
      p.work->finish(seconds_since(p.start));
      continue;
    }
    // A receive is cancelled (it completes locally). A send would go on
    // reading a buffer its caller is about to free: a parallel job ends
    // instead, while the buffer is alive.
    // (A receive already matched to a message still arriving cannot be
    // cancelled: it gets comm.timeout_s to complete, then the job ends.)
    if (p.op.kind == "recv") {
      MPI_Cancel(&p.req);
      const auto t0 = Clock::now();
      int completed = 0;
      while (MPI_Test(&p.req, &completed, MPI_STATUS_IGNORE), !completed) {
        if (seconds_since(t0) > options_.timeout_s) {
          fail_fast(
              format("group '{}' rank {}: destroyed with {} that could not be cancelled "
                     "({})",
                     name_, rank_, p.op.describe(), abandon_cause_));
          MPI_Request_free(&p.req);  // no handler (one process): left to MPI
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      fail_fast(format("group '{}' rank {}: destroyed with {} in flight ({})", name_, rank_,
                       p.op.describe(), abandon_cause_));
      MPI_Request_free(&p.req);
    }
    p.work->fail(format("group '{}' rank {}: {}: cancelled: the group was destroyed", name_, rank_,
                        p.op.describe()));
  }
  p2p_.clear();
}

void MpiProcessGroup::wait_requests(MPI_Request* reqs, int n, const Op& op) {
  if (n == 0) return;
  // Capped at 1e9 s (about 30 years) so the conversion cannot overflow.
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::min(options_.timeout_s, 1e9)));
  for (int spins = 0;; ++spins) {
    int done = 0;
    MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
    if (done) return;
    // The group is being destroyed with this collective in flight: give it
    // up rather than wait on peers (its requests die with the job).
    if (abandoned_.load())
      LOOM_FAIL(kComm, "abandoned in flight: the group was destroyed before its peers arrived");
    poll_p2p();
    if (Clock::now() > deadline) timed_out(op);
    // Spin briefly for latency, then sleep so the compute threads keep the cores.
    if (spins < 2000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void MpiProcessGroup::timed_out(const Op& op) {
  if (op.kind == "send" || op.kind == "recv") {
    // Only the peer takes part, and point-to-point operations are numbered
    // apart from the collectives: the group's collective counters say
    // nothing about it. Name the message and the peer instead.
    const int peer = op.arg;
    runtime_->abort(
        format("comm timeout: {}{}{} in group '{}' did not complete within comm.timeout_s = {} s: "
               "its peer, rank {} of the group (world rank {}), never posted the matching {} "
               "(it is blocked earlier, or its schedule differs)",
               op.what.empty() ? "" : op.what, op.what.empty() ? "" : ": ", op.describe(), name_,
               options_.timeout_s, peer, members_[static_cast<size_t>(peer)],
               op.kind == "send" ? "receive" : "send"),
        3);
  }
  // Ask every other member how far its copy of this group got.
  const int n = size_;
  std::vector<uint64_t> answers(static_cast<size_t>(n), 0);
  std::vector<MPI_Request> reqs;
  std::vector<int> asked;
  int id = id_;
  for (int i = 0; i < n; ++i) {
    if (i == rank_) continue;
    int world_rank = members_[i];
    reqs.emplace_back();
    MPI_Isend(&id, 1, MPI_INT, world_rank, kQueryTag, runtime_->control_, &reqs.back());
    reqs.emplace_back();
    MPI_Irecv(&answers[i], 1, MPI_UINT64_T, world_rank, kReplyTagBase + id, runtime_->control_,
              &reqs.back());
    asked.push_back(i);
  }
  auto until = Clock::now() + std::chrono::seconds(2);
  std::vector<int> answered(reqs.size(), 0);
  while (Clock::now() < until) {
    bool all = true;
    for (size_t k = 0; k < reqs.size(); ++k) {
      if (!answered[k]) MPI_Test(&reqs[k], &answered[k], MPI_STATUS_IGNORE);
      all = all && answered[k];
    }
    if (all) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // A host none of whose members in this group answered is out of reach
  // (a cut link, a lost machine), as far as this rank can tell.
  const Topology& topo = runtime_->topology();
  auto host_name = [&](int i) {
    return topo.names[static_cast<size_t>(topo.host_of[static_cast<size_t>(members_[i])])];
  };
  std::vector<int> members_on(static_cast<size_t>(topo.hosts()), 0),
      silent_on(static_cast<size_t>(topo.hosts()), 0);
  for (int i = 0; i < n; ++i) members_on[static_cast<size_t>(topo.host_of[members_[i]])]++;
  std::string missing, silent;
  for (size_t a = 0; a < asked.size(); ++a) {
    int i = asked[a];
    if (!answered[2 * a + 1]) {
      silent +=
          format("{}{} (world {} on {})", silent.empty() ? "" : ", ", i, members_[i], host_name(i));
      silent_on[static_cast<size_t>(topo.host_of[members_[i]])]++;
    } else if (answers[i] < op.seq) {
      missing += format("{}{} (world {} on {}, at #{})", missing.empty() ? "" : ", ", i,
                        members_[i], host_name(i), answers[i]);
    }
  }
  std::string lost;
  for (int h = 0; h < topo.hosts(); ++h)
    if (silent_on[h] > 0 && silent_on[h] == members_on[h])
      lost += (lost.empty() ? "" : ", ") + topo.names[static_cast<size_t>(h)];
  std::string report = format(
      "comm timeout: {} in group '{}' (size {}) did not complete within comm.timeout_s = {} s; "
      "ranks that had not arrived: {}; ranks that did not answer: {}{}",
      op.describe(), name_, size_, options_.timeout_s, missing.empty() ? "none" : missing,
      silent.empty() ? "none" : silent,
      lost.empty() ? ""
                   : format("; unreachable host{}: {}",
                            lost.find(',') == std::string::npos ? "" : "s", lost));
  runtime_->abort(report, 3);
}

void MpiProcessGroup::check_descriptors(const Op& op) {
  // An all-to-all's total count differs from rank to rank by design.
  const int64_t count = op.kind == "alltoall" ? 0 : static_cast<int64_t>(op.count);
  int64_t mine[5] = {kind_code(op.kind), count, static_cast<int64_t>(op.dtype), op.arg,
                     static_cast<int64_t>(op.seq)};
  std::vector<int64_t> all(static_cast<size_t>(5 * size_));
  MPI_Request req;
  MPI_Iallgather(mine, 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, comm_, &req);
  wait_requests(&req, 1, op);
  for (int r = 0; r < size_; ++r) {
    const int64_t* d = all.data() + 5 * r;
    if (std::equal(d, d + 5, mine)) continue;
    Op other;
    other.kind = d[0] >= 0 && d[0] < kNumKinds ? kKinds[d[0]] : "unknown";
    other.count = static_cast<size_t>(d[1]);
    other.dtype = static_cast<DType>(d[2]);
    other.arg = static_cast<int>(d[3]);
    other.seq = static_cast<uint64_t>(d[4]);
    LOOM_FAIL(kComm,
              "mismatched collectives at position #{}: rank {} called {} but rank {} "
              "called {}",
              op.seq, rank_, op.describe(), r, other.describe());
  }
}

}  // namespace loom
