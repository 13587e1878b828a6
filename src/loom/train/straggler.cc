#include "loom/train/straggler.h"

#include <algorithm>

#include "loom/core/error.h"

namespace loom {

namespace {
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(mid), v.end());
  if (v.size() % 2 == 1) return v[mid];
  const double hi = v[mid];
  return (hi + *std::max_element(v.begin(), v.begin() + static_cast<long>(mid))) / 2;
}
}  // namespace

StragglerDetector::StragglerDetector(int ranks, int window, double threshold)
    : ranks_(ranks), window_(window), threshold_(threshold),
      scores_(static_cast<size_t>(ranks), 1.0) {
  LOOM_CHECK(ranks >= 1 && window >= 1, "straggler detector: {} ranks, window {}", ranks, window);
}

const std::vector<double>& StragglerDetector::add(const std::vector<double>& compute) {
  LOOM_CHECK(static_cast<int>(compute.size()) == ranks_, "straggler detector: {} times for {} ranks",
             compute.size(), ranks_);
  history_.push_back(compute);
  if (static_cast<int>(history_.size()) > window_) history_.pop_front();
  std::vector<double> per_rank(static_cast<size_t>(ranks_));
  for (int r = 0; r < ranks_; ++r) {
    std::vector<double> t;
    for (const auto& step : history_) t.push_back(step[static_cast<size_t>(r)]);
    per_rank[static_cast<size_t>(r)] = median(t);
  }
  const double typical = median(per_rank);
  for (int r = 0; r < ranks_; ++r) {
    const double mine = per_rank[static_cast<size_t>(r)];
    scores_[static_cast<size_t>(r)] = mine > 0 ? std::min(1.0, typical / mine) : 1.0;
  }
  std::vector<int> slow;
  for (int r = 0; r < ranks_ && full(); ++r) {
    const double s = scores_[static_cast<size_t>(r)];
    const bool was = std::find(slow_.begin(), slow_.end(), r) != slow_.end();
    if (s < threshold_ || (was && s < threshold_ + kHysteresis)) slow.push_back(r);
  }
  slow_ = slow;
  return scores_;
}

}  // namespace loom
