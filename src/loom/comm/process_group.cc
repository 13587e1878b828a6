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
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

Work::Work(std::string what, double timeout_s) : what_(std::move(what)), timeout_s_(timeout_s) {}

void Work::wait() {
  if (timeout_s_ <= 0) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    if (!error_.empty()) throw Error(ErrorKind::kComm, error_);
    return;
  }
  // The deadline moves once the worker starts the operation; re-read it on
  // every wake-up.
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    const auto from = started_set_ ? started_ : issued_;
    const auto deadline =
        from + std::chrono::duration_cast<Clock::duration>(
                   std::chrono::duration<double>(std::min(timeout_s_, 1e9) + kWaitSlackS));
    if (cv_.wait_until(lock, deadline, [this] { return done_; })) break;
    if ((started_set_ ? started_ : issued_) == from) {
      lock.unlock();
      wait_until(Clock::now(), timeout_s_);  // throws: nothing moved since the deadline was set
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.empty()) throw Error(ErrorKind::kComm, error_);
}

void Work::wait(double timeout_s) {
  wait_until(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(std::min(timeout_s, 1e9))),
             timeout_s);
}

void Work::wait_until(Clock::time_point deadline, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [this] { return done_; }))
    throw Error(ErrorKind::kComm,
                format("comm timeout: {} did not complete within {} s of waiting ({}); this "
                       "rank's communication worker did not finish it (blocked in an earlier "
                       "operation or a blocking call)",
                       what_.empty() ? "an operation" : what_, timeout_s,
                       started_set_ ? "started on the worker" : "never started on the worker"));
  if (!error_.empty()) throw Error(ErrorKind::kComm, error_);
}

void Work::mark_started() {
  std::lock_guard<std::mutex> lock(mu_);
  started_ = Clock::now();
  started_set_ = true;
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
