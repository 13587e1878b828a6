// log.trace: the timeline of a run's first steps, every rank on one time
// axis (seconds from an origin the ranks take together after a barrier):
// compute per unit use (the embeddings, each block, the head; forward,
// backward, recompute), the pipeline's instructions when the run is
// pipelined, and every collective and message, one row per group. Written
// as trace.json (Chrome's trace format: Perfetto, chrome://tracing), a
// process per rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/comm/parallel_context.h"
#include "loom/comm/record.h"
#include "loom/model/gpt_stage.h"
#include "loom/parallel/pipeline/executor.h"

namespace loom {

class RunTrace {
 public:
  // Keeps the events of steps 1 .. steps_kept.
  RunTrace(double origin, int64_t steps_kept);
  // Records the stage's unit uses (the store's observer) from now on; the
  // trace must outlive the stage's steps.
  void observe(GptStage<float>& stage);
  // The step (1-based) the following events belong to.
  void begin_step(int64_t step);
  void add_comm(const std::vector<CommEvent>& events);
  void add_schedule(const std::vector<pp::TraceSlice>& slices);
  bool keeping() const { return step_ >= 1 && step_ <= kept_; }
  size_t events() const { return events_.size(); }

  // Every rank's events to the writer, which writes trace.json at `path`
  // (collective over the context's world; `label` names each rank's row).
  void write(const ParallelContext& ctx, bool writer, const std::string& path) const;

 private:
  int tid_of(const std::string& group);
  void add(int tid, std::string name, std::string cat, double start, double end,
           nlohmann::json args);

  double origin_;
  int64_t kept_, step_ = 0;
  std::vector<std::string> groups_;  // the comm rows, in order of first use
  nlohmann::json events_ = nlohmann::json::array();
  // Per unit, when its current use began (-1: not in use).
  std::vector<std::vector<double>> open_;
};

}  // namespace loom
