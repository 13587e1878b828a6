#include "loom/comm/process_group.h"

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

void Work::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  if (!error_.empty()) throw Error(ErrorKind::kComm, error_);
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
