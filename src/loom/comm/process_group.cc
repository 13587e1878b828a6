#include "loom/comm/process_group.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "?";
}

bool Work::test() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) return false;
    if (!error_.empty()) return true;  // a failed operation reaches no event
  }
  return !event_ || event_->query();
}

Work::Work(std::string what, double timeout_s) : what_(std::move(what)), timeout_s_(timeout_s) {}

void Work::wait() {
  wait_host();  // throws for a failed operation, whose event is never reached
  if (event_) event_->synchronize();
}

void Work::wait_host() {
  if (timeout_s_ > 0) {
    // No caller deadline while the operation waits in the worker's queue:
    // the worker enforces the deadline of whatever runs ahead of it, and a
    // healthy op may wait there longer than timeout_s behind a slow peer.
    // Once started it has timeout_s + kWaitSlackS.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_ || started_set_; });
    if (!done_) {
      const auto deadline =
          started_ + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(std::min(timeout_s_, 1e9) + kWaitSlackS));
      lock.unlock();
      wait_until(deadline, timeout_s_ + kWaitSlackS);
      return;
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  if (!error_.empty()) throw Error(ErrorKind::kComm, error_);
}

void Work::wait(double timeout_s) {
  wait_until(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(std::min(timeout_s, 1e9))),
             timeout_s);
  if (event_) event_->synchronize();
}

void Work::wait_until(Clock::time_point deadline, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [this] { return done_; })) {
    const std::string message = format(
        "comm timeout: {} did not complete within {} s of waiting ({}); this rank's "
        "communication worker did not finish it",
        what_.empty() ? "an operation" : what_, timeout_s,
        started_set_ ? "started on the worker" : "never started on the worker");
    lock.unlock();
    // The worker still owns the caller's buffers: a parallel job ends here
    // rather than unwind under it.
    fail_fast(message);
    throw Error(ErrorKind::kComm, message);
  }
  if (!error_.empty()) throw Error(ErrorKind::kComm, error_);
}

void Work::mark_started() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    started_ = Clock::now();
    started_set_ = true;
  }
  cv_.notify_all();  // a waiter takes up the deadline from here
}

double Work::seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seconds_;
}

void Work::finish(double seconds) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    seconds_ = seconds;
  }
  cv_.notify_all();
}

void Work::fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = reason;
  }
  cv_.notify_all();
}

}  // namespace loom
