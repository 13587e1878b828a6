// The record of every collective and message a rank issues, as it ran: the
// group, the kind, the element type the caller gave and the one that crossed
// the wire, the bytes this rank sent, and when the operation was enqueued,
// started on its group's worker and ended. Every group of a process appends
// to the one record its runtime holds (a bounded ring: the oldest events go
// first when nobody takes them). The trainer takes the events after each
// step: the metrics' comm_bytes and per-group totals are their sums, and the
// trace (log.trace) draws each one on the rank's timeline.
//
// Bytes sent are counted message by message for point-to-point messages,
// all-to-all and loom's own all-reduce algorithms (ring, rhd, hierarchical);
// for MPI's own collectives, whose inner messages MPI does not show, they
// are the volume of the bandwidth-optimal algorithm (all-reduce 2 (p - 1) / p
// of the message, reduce-scatter and all-gather (p - 1) / p of the whole,
// broadcast (p - 1) / p of the message), and the event says so (exact =
// false). Events are keyed by the group's name: a grid group that is the
// whole job (dp on a data-parallel-only job) is the world, named "world".
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "loom/core/dtype.h"

namespace loom {

// Seconds on the steady clock: one axis for every thread of a host.
double comm_clock();

struct CommEvent {
  std::string group;          // the group's name ("dp", "tp", "pp", "world", ...)
  std::string kind;           // "allreduce", "reducescatter", "allgather", "broadcast",
                              // "alltoall", "barrier", "send", "recv"
  std::string algo;           // an all-reduce's algorithm ("mpi", "ring", ...); else ""
  DType dtype = DType::kF32;  // the caller's element type
  DType wire = DType::kF32;   // the element type that crossed the wire
  size_t count = 0;           // elements, as the caller gave them
  int peer = -1;              // send and receive: the other rank (in the group)
  double sent_bytes = 0;      // bytes this rank sent to the others
  bool exact = true;          // sent_bytes counted message by message (else: the model above)
  bool failed = false;        // the operation failed (its Work threw); bytes as far as known
  double enqueued = 0, started = 0, ended = 0;  // comm_clock() seconds
};

// Per group: what a span of events added up to.
struct CommTotals {
  std::string group;
  int ops = 0;
  double sent_bytes = 0;
  double seconds = 0;  // sum over the operations of end - start (on the group's worker)
};
std::vector<CommTotals> totals_by_group(const std::vector<CommEvent>& events);

class CommRecord {
 public:
  explicit CommRecord(size_t capacity = 1 << 16);
  void add(CommEvent e);
  // The events added since the last take, oldest first.
  std::vector<CommEvent> take();
  // Events lost because the ring was full before a take.
  uint64_t dropped() const;

 private:
  mutable std::mutex mu_;
  std::vector<CommEvent> ring_;
  size_t capacity_, head_ = 0, size_ = 0;
  uint64_t dropped_ = 0;
};

}  // namespace loom
