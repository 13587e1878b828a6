// ProcessGroup: the interface every parallel strategy talks through. A group
// is an ordered set of ranks; each collective is asynchronous and returns a
// Work whose wait() blocks until it completes and throws Error(kComm) when it
// failed or timed out.
//
// Contract (as for every collective library): all members call the group's
// collectives in the same order with matching sizes, dtypes and operations.
// Different groups are independent: their operations may interleave in any
// order across ranks. Buffers must stay valid and untouched until wait()
// returns. `in == out` is allowed everywhere (in place).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/event.h"

namespace loom {

class CommRecord;

enum class ReduceOp { kSum, kAvg, kMax };
const char* reduce_op_name(ReduceOp op);

// Completion of one asynchronous operation. A Work made with a description
// and a timeout has a deadline: wait() gives up timeout_s + kWaitSlackS after
// the operation started on the backend's worker (queued behind others, it
// waits for the worker, which enforces their deadlines) and, in a parallel
// job, ends it (fail_fast), else throws Error(kComm) naming it. The
// worker enforces the operation's own deadline first, with a report of the
// ranks that did not answer; the caller's deadline covers a worker that is
// itself stuck.
class Work {
 public:
  static constexpr double kWaitSlackS = 5;
  Work() = default;  // no deadline
  Work(std::string what, double timeout_s);

  // True once finished (successfully or not), on the device too when the
  // operation succeeded and carries an event.
  bool test() const;
  // Blocks; throws Error(kComm) with the reason on failure or timeout. With
  // an event, also until the device has passed it.
  void wait();
  // As wait(), giving up after timeout_s seconds from now (the device's
  // event, once the host side is done, is waited for without a deadline).
  void wait(double timeout_s);
  // As wait() without waiting for the event: the operation is issued and
  // its errors known; a consumer on the device orders itself after event().
  void wait_host();
  // The device-ordered completion, null for host operations.
  const std::shared_ptr<const DeviceEvent>& event() const { return event_; }
  // Seconds between the start of the operation on the worker and its end.
  double seconds() const;

  // Called by the backend.
  void mark_started();
  void finish(double seconds);
  void fail(const std::string& reason);
  // Before finish(): the operation completes on a device at this event.
  void set_event(std::shared_ptr<const DeviceEvent> e) { event_ = std::move(e); }

 private:
  using Clock = std::chrono::steady_clock;
  void wait_until(Clock::time_point deadline, double timeout_s);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  double seconds_ = 0;
  std::string what_;
  double timeout_s_ = 0;  // 0: none
  Clock::time_point issued_ = Clock::now();
  Clock::time_point started_{};
  bool started_set_ = false;
  std::shared_ptr<const DeviceEvent> event_;
};
using WorkPtr = std::shared_ptr<Work>;

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;

  // out (count) = op over ranks of in (count).
  virtual WorkPtr all_reduce(const void* in, void* out, size_t count, DType t, ReduceOp op) = 0;
  // in (size * count) reduced; rank r receives block r into out (count).
  virtual WorkPtr reduce_scatter(const void* in, void* out, size_t count, DType t, ReduceOp op) = 0;
  // out (size * count) = every rank's in (count), in rank order.
  virtual WorkPtr all_gather(const void* in, void* out, size_t count, DType t) = 0;
  virtual WorkPtr broadcast(void* buf, size_t count, DType t, int root) = 0;
  // Sends send_counts[r] elements to rank r (consecutive blocks of in) and
  // receives recv_counts[r] from rank r (consecutive blocks of out).
  virtual WorkPtr all_to_all(const void* in, const std::vector<size_t>& send_counts, void* out,
                             const std::vector<size_t>& recv_counts, DType t) = 0;
  // Point-to-point. `what` says what the message is for the caller ("the
  // activation of micro-batch 3 to stage 2"); a timeout report names it.
  virtual WorkPtr send(const void* buf, size_t count, DType t, int peer, int tag,
                       const std::string& what = {}) = 0;
  virtual WorkPtr recv(void* buf, size_t count, DType t, int peer, int tag,
                       const std::string& what = {}) = 0;
  virtual WorkPtr barrier() = 0;
  // Where the group records each operation as it ran (comm/record.h); null:
  // not recorded.
  virtual CommRecord* record() const { return nullptr; }
};

// Every rank's n values of an 8-byte type (double, size_t), in rank order,
// as raw bytes (an all-gather copies them unchanged).
template <typename T>
std::vector<T> all_gather_words(ProcessGroup& group, const T* in, size_t n) {
  static_assert(sizeof(T) == 8, "an 8-byte type");
  std::vector<T> out(n * static_cast<size_t>(group.size()));
  group.all_gather(in, out.data(), sizeof(T) * n, DType::kU8)->wait();
  return out;
}

}  // namespace loom
