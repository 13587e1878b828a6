// Stragglers: in a synchronous job every rank's step takes as long as the
// slowest rank's, so step time cannot tell them apart; the time a rank
// spends computing (its step less the time it waited on communication)
// can. Each rank's score is the median compute of its peers over its own
// (its own median over the last `window` steps; of an even number of peers
// the lower middle one), capped at 1: 1 is as fast as
// the median peer, 0.5 is a rank that needs twice as long. Peers are the
// ranks of the same class (the same pipeline stage: stages differ in work
// by design). A rank below the threshold over a full window is
// persistently slow.
#pragma once

#include <deque>
#include <vector>

namespace loom {

class StragglerDetector {
 public:
  // Why 20 steps and 0.8 (a rank 25% slower than the median):
  // docs/hosts.md#stragglers, from the spread measured on healthy runs.
  static constexpr int kWindow = 20;
  static constexpr double kThreshold = 0.8;
  // A slow rank counts as recovered only above threshold + this, so a rank
  // near the line is not reported on and off every step.
  static constexpr double kHysteresis = 0.1;

  // classes[r]: rank r's class (empty: one class).
  explicit StragglerDetector(int ranks, std::vector<int> classes = {}, int window = kWindow,
                             double threshold = kThreshold);
  // Adds one step's compute seconds per rank; returns every rank's score.
  const std::vector<double>& add(const std::vector<double>& compute);
  const std::vector<double>& scores() const { return scores_; }
  bool full() const { return static_cast<int>(history_.size()) >= window_; }
  // Ranks persistently slow: below the threshold with a full window, and
  // not yet back above threshold + kHysteresis.
  const std::vector<int>& slow() const { return slow_; }
  double threshold() const { return threshold_; }
  int window() const { return window_; }

 private:
  int ranks_;
  std::vector<int> classes_;
  int window_;
  double threshold_;
  std::deque<std::vector<double>> history_;  // the last `window` steps, per rank
  std::vector<double> scores_;
  std::vector<int> slow_;
};

}  // namespace loom
