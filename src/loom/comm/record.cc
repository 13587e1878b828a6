#include "loom/comm/record.h"

#include <chrono>
#include <utility>

#include "loom/core/error.h"

namespace loom {

double comm_clock() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<CommTotals> totals_by_group(const std::vector<CommEvent>& events) {
  std::vector<CommTotals> out;
  for (const CommEvent& e : events) {
    size_t k = 0;
    while (k < out.size() && out[k].group != e.group) ++k;
    if (k == out.size()) out.push_back(CommTotals{e.group});
    out[k].ops += 1;
    out[k].sent_bytes += e.sent_bytes;
    out[k].seconds += e.ended - e.started;
  }
  return out;
}

CommRecord::CommRecord(size_t capacity) : capacity_(capacity) {
  LOOM_CHECK(capacity > 0, "a communication record needs room for one event");
}

void CommRecord::add(CommEvent e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ring_.size() < capacity_) ring_.resize(capacity_);
  const size_t at = (head_ + size_) % capacity_;
  ring_[at] = std::move(e);
  if (size_ < capacity_) {
    ++size_;
  } else {
    head_ = (head_ + 1) % capacity_;  // the oldest is overwritten
    ++dropped_;
  }
}

std::vector<CommEvent> CommRecord::take() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<CommEvent> out;
  out.reserve(size_);
  for (size_t i = 0; i < size_; ++i) out.push_back(std::move(ring_[(head_ + i) % capacity_]));
  head_ = size_ = 0;
  return out;
}

uint64_t CommRecord::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

}  // namespace loom
