#include "loom/train/straggler.h"

#include <algorithm>
#include <utility>

#include "loom/core/error.h"

namespace loom {

namespace {
// The median; of an even count the lower middle value, so that of two
// peers the faster one is the measure.
double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t mid = (v.size() - 1) / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(mid), v.end());
  return v[mid];
}
}  // namespace

StragglerDetector::StragglerDetector(int ranks, std::vector<int> classes, int window,
                                     double threshold)
    : ranks_(ranks),
      classes_(std::move(classes)),
      window_(window),
      threshold_(threshold),
      scores_(static_cast<size_t>(ranks), 1.0) {
  LOOM_CHECK(ranks >= 1 && window >= 1, "straggler detector: {} ranks, window {}", ranks, window);
  if (classes_.empty()) classes_.assign(static_cast<size_t>(ranks), 0);
  LOOM_CHECK(static_cast<int>(classes_.size()) == ranks,
             "straggler detector: {} classes for {} ranks", classes_.size(), ranks);
}

const std::vector<double>& StragglerDetector::add(const std::vector<double>& compute) {
  LOOM_CHECK(static_cast<int>(compute.size()) == ranks_,
             "straggler detector: {} times for {} ranks", compute.size(), ranks_);
  history_.push_back(compute);
  if (static_cast<int>(history_.size()) > window_) history_.pop_front();
  std::vector<double> per_rank(static_cast<size_t>(ranks_));
  for (int r = 0; r < ranks_; ++r) {
    std::vector<double> t;
    for (const auto& step : history_) t.push_back(step[static_cast<size_t>(r)]);
    per_rank[static_cast<size_t>(r)] = median(t);
  }
  for (int r = 0; r < ranks_; ++r) {
    std::vector<double> peers;
    for (int q = 0; q < ranks_; ++q)
      if (classes_[static_cast<size_t>(q)] == classes_[static_cast<size_t>(r)])
        peers.push_back(per_rank[static_cast<size_t>(q)]);
    const double typical = median(peers);
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
