// NcclProcessGroup (built with -DLOOM_CUDA=ON): the ProcessGroup interface
// over an NCCL communicator, one GPU per rank, for the CUDA backend.
//
// Bootstrapped over an existing group (MPI's): rank 0 makes the NCCL
// unique id and the bootstrap group broadcasts it; every member joins a
// non-blocking communicator on `device`, so that a join that does not
// finish within the timeout is aborted (ncclCommAbort) and reported instead
// of hanging.
//
// Each operation is queued on the group's own CUDA stream and returns a
// Work whose event() completes on the device (Work::wait() waits for it;
// a backend with a stream orders itself after it). Buffers in device or
// managed memory are used in place; a buffer in plain host memory (a
// vector of statistics, a caller's scalars) goes through a device copy and
// the operation completes before it returns.
//
// The watchdog thread polls every queued operation: one that has not
// completed by its deadline (comm.timeout_s), or an asynchronous NCCL error
// (a peer that died, a network failure), aborts the communicator and ends
// the job with the group, the rank and the operation named (fail_fast), as
// the MPI groups do. Waits on an aborted group throw Error(kComm).
//
// Point-to-point: NCCL has no tags; messages between two ranks match in the
// order they are posted, so callers post sends and receives to a peer in
// the same order on both sides (the tag is kept for the record and the
// messages). The record holds every operation (algo "nccl"); bytes by the
// bandwidth-optimal model for collectives (exact = false), exact for
// messages and all-to-all.
#pragma once

#include <memory>
#include <string>

#include "loom/comm/process_group.h"

namespace loom {

class NcclProcessGroup final : public ProcessGroup {
 public:
  // Collective over `bootstrap` (every member calls it). Throws
  // Error(kComm) naming the NCCL error, or the timeout, when the
  // communicator cannot be made.
  static std::shared_ptr<NcclProcessGroup> create(ProcessGroup& bootstrap, std::string name,
                                                  int device, double timeout_s, CommRecord* record);
  ~NcclProcessGroup() override;

  int rank() const override;
  int size() const override;
  const std::string& name() const override;

  WorkPtr all_reduce(const void* in, void* out, size_t count, DType t, ReduceOp op) override;
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
  CommRecord* record() const override;

  struct State;

 private:
  explicit NcclProcessGroup(std::shared_ptr<State> s);
  std::shared_ptr<State> s_;  // shared with the device events of its operations
};

// The NCCL library's version ("2.28.3"), for logs.
std::string nccl_version();

}  // namespace loom
