// The MPI backend (Open MPI 4.1) of ProcessGroup.
//
// Threading model: MPI is initialised with MPI_THREAD_MULTIPLE and every
// group owns one worker thread that issues all of that group's MPI calls, in
// the order the caller enqueued them. Why:
// - one FIFO per group gives the ordering contract per group, while separate
//   groups (tp, dp, pp, ...) progress independently, so their operations may
//   interleave differently on different ranks without deadlock (a single
//   worker for all groups would serialise them into one global order);
// - the worker starts nonblocking MPI operations and polls them with
//   MPI_Test, which is what makes Open MPI progress a collective while the
//   caller's threads compute (it progresses only inside MPI calls);
// - polling is where the deadline is enforced: a blocking MPI call cannot be
//   interrupted, a poll loop can give up, report and abort the job.
// The poll loop spins briefly, then sleeps in short intervals, so a waiting
// worker costs little CPU beside the compute threads. Collectives complete in
// queue order; sends and receives are posted in order and complete in the
// background, so exchanges (everyone sends, then receives) cannot deadlock.
//
// Timeouts: an operation that has not completed within comm.timeout_s makes
// this rank ask every member of the group (through a control communicator
// answered by each process's watchdog thread) how far it got, print a report
// (group, operation, sequence number, size, which ranks had not arrived) and
// abort the whole job with MPI_Abort. With comm.debug, every collective is
// preceded by an exchange of descriptors, and a mismatch (another operation,
// size, dtype or root at the same sequence number) is reported by name.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/comm/record.h"
#include "loom/comm/topology.h"
#include "loom/kernels/backend.h"

namespace loom {

struct CommOptions {
  double timeout_s = 600;              // comm.timeout_s
  std::string allreduce = "mpi";       // comm.allreduce: mpi | ring | rhd | hierarchical | auto
  int ranks_per_node = 0;              // comm.ranks_per_node; 0: MPI's shared-memory split
  std::string placement = "topology";  // comm.placement: topology | launcher (grid.h, topology.h)
  bool debug = false;                  // comm.debug: descriptor exchange before each collective
  // comm.payloads: auto (a bf16 run's tensor-parallel, pipeline and
  // all-to-all tensors travel in bf16) | f32. Read by the training layers.
  std::string payloads = "auto";
  // comm.backend: auto | mpi | nccl: what the grid's groups run over
  // (train/device.h makes the NCCL groups).
  std::string backend = "auto";
};

class MpiProcessGroup;

// MPI_Init_thread .. MPI_Finalize, and the watchdog thread that answers
// "how far did you get" queries. main() owns exactly one.
class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // Ranks of this job on this host (MPI's shared-memory split).
  int node_size() const { return node_size_; }
  // Which launch ranks share a host, and the hosts' names.
  const Topology& topology() const { return topology_; }
  // The group of all ranks.
  std::shared_ptr<MpiProcessGroup> world(const CommOptions& options);
  // Every operation of every group of this process, as it ran.
  CommRecord& record() { return record_; }
  // Ends the job from any rank with this message (printed first). Should
  // MPI_Abort not end this rank within kAbortGraceS (a launcher it cannot
  // reach), the rank exits by itself.
  [[noreturn]] void abort(const std::string& message, int code = 1);
  static constexpr double kAbortGraceS = 5;

 private:
  friend class MpiProcessGroup;
  void register_group(MpiProcessGroup* g);
  void unregister_group(MpiProcessGroup* g);
  void serve_queries();
  void discover_topology();

  Topology topology_;
  CommRecord record_;
  int world_rank_ = 0, world_size_ = 1, node_size_ = 1;
  MPI_Comm control_ = MPI_COMM_NULL;  // watchdog queries and answers
  std::mutex groups_mu_;
  std::vector<MpiProcessGroup*> groups_;
  int next_group_id_ = 0;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

class MpiProcessGroup : public ProcessGroup {
 public:
  MpiProcessGroup(MpiRuntime* runtime, MPI_Comm comm, std::string name, CommOptions options);
  ~MpiProcessGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const CommOptions& options() const { return options_; }
  // Global (world) rank of each member, in group order.
  const std::vector<int>& members() const { return members_; }
  MpiRuntime* runtime() const { return runtime_; }

  // Splits this group into the groups listed (each a list of ranks of this
  // group, disjoint); collective over this group, which every
  // member calls with the same list. Returns the group holding this rank
  // (null when it is in none).
  std::shared_ptr<MpiProcessGroup> split(const std::vector<std::vector<int>>& groups,
                                         const std::string& name);

  WorkPtr all_reduce(const void* in, void* out, size_t count, DType t, ReduceOp op) override;
  // The same with an explicit algorithm: "mpi", "ring", "rhd", "hierarchical", "auto".
  WorkPtr all_reduce_with(const std::string& algo, const void* in, void* out, size_t count, DType t,
                          ReduceOp op);
  WorkPtr reduce_scatter(const void* in, void* out, size_t count, DType t, ReduceOp op) override;
  WorkPtr all_gather(const void* in, void* out, size_t count, DType t) override;
  WorkPtr broadcast(void* buf, size_t count, DType t, int root) override;
  WorkPtr all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                     const std::vector<size_t>& recv_counts, DType t) override;
  WorkPtr send(const void* buf, size_t count, DType t, int peer, int tag,
               const std::string& what = {}) override;
  WorkPtr recv(void* buf, size_t count, DType t, int peer, int tag,
               const std::string& what = {}) override;
  WorkPtr barrier() override;
  CommRecord* record() const override { return runtime_ ? &runtime_->record() : nullptr; }

  // What comm.allreduce "auto" runs for a message of `bytes` on this group.
  std::string choose_algorithm(size_t bytes) const;
  // Collectives this group has started (watchdog answers use it).
  uint64_t started() const { return started_.load(); }
  int id() const { return id_; }

 private:
  friend class MpiRuntime;
  struct Op {
    std::string kind;  // "allreduce", ...
    size_t count = 0;
    DType dtype = DType::kF32;
    int arg = 0;            // reduce op or root
    uint64_t seq = 0;       // this group's sequence number, from 1
    std::string what = {};  // point-to-point: the caller's account of the message
    // Filled in as it runs, for the record (comm/record.h).
    std::string algo = {};     // an all-reduce's algorithm
    DType wire = DType::kF32;  // what crossed the wire
    double sent = 0;           // bytes this rank sent
    bool exact = true;         // counted (else the algorithm's known volume)
    double enqueued = 0;       // comm_clock() when the caller enqueued it
    std::string describe() const;
  };
  WorkPtr enqueue(Op op, std::function<void(Op&)> body);
  void add_record(const Op& op, double started, bool failed = false);  // into the runtime's record
  // Send and receive: the worker posts the request and goes on with the next
  // operation; the request completes in the background (see poll_p2p), so a
  // send queued before a receive cannot block it, whatever the message size.
  WorkPtr enqueue_p2p(Op op, std::function<void(MPI_Request*)> post);
  void poll_p2p();    // completes finished point-to-point requests; enforces their deadline
  void cancel_p2p();  // the group is going away: cancels what is still in flight
  void run_worker();
  // x (n) divided by the group's size: the sum times 1 / size, on the backend.
  void average(float* x, size_t n) const {
    be_.scale(x, static_cast<int64_t>(n), 1.0f / static_cast<float>(size_));
  }
  // A bf16 or f16 reduction with 16 bits on the wire: one all-to-all hands
  // every rank its block of each rank's input, summed in f32 in rank order
  // (divided for kAvg) and rounded once; `all` then all-gathers the blocks
  // (an all-reduce of `count`), else each rank keeps its block (a
  // reduce-scatter of `count` per rank from `count` x size inputs).
  void reduce_16(Op& o, const void* in, void* out, size_t count, DType t, ReduceOp op, bool all);
  // Polls until all requests complete; on the deadline, reports and aborts.
  void wait_requests(MPI_Request* reqs, int n, const Op& op);
  void check_descriptors(const Op& op);
  [[noreturn]] void timed_out(const Op& op);

  // Algorithms on point-to-point messages (comm/algorithms), run on the worker.
  void ring_all_reduce(float* data, size_t count, const Op& op);
  void rhd_all_reduce(float* data, size_t count, const Op& op);
  void hierarchical_all_reduce(float* data, size_t count, const Op& op);

  MpiRuntime* runtime_;
  MPI_Comm comm_;
  std::string name_;
  CommOptions options_;
  int rank_ = 0, size_ = 1, id_ = 0;
  std::vector<int> members_;
  std::atomic<uint64_t> started_{0};
  uint64_t next_seq_ = 0;      // collectives, caller side
  uint64_t next_p2p_seq_ = 0;  // sends and receives, caller side
  bool equal_nodes_ = false;   // every node of this group has the same size
  int node_size_ = 1;          // members of this group on this rank's node
  bool spans_hosts_ = false;   // the group has members on more than one host
  // Node structure for the hierarchical all-reduce (sub-communicators of comm_).
  MPI_Comm node_comm_ = MPI_COMM_NULL, cross_comm_ = MPI_COMM_NULL;

  struct PendingP2p {
    MPI_Request req;
    WorkPtr work;
    Op op;
    std::chrono::steady_clock::time_point start;
    double started = 0;  // comm_clock() at the post
  };
  std::vector<PendingP2p> p2p_;  // worker thread only

  std::mutex mu_;
  std::condition_variable cv_;
  struct Task {
    WorkPtr work;
    std::function<void()> run;
  };
  std::deque<Task> queue_;
  bool stop_ = false;
  std::atomic<bool> abandoned_{false};  // the destructor runs: a collective in flight gives up
  std::string abandon_cause_;           // last_error() of the destroying thread (under mu_)
  // The host backend the worker converts, sums and averages on.
  const Backend<float>& be_ = default_backend<float>();
  std::thread worker_;
};

}  // namespace loom
