// log.profile: where a run's time, FLOPs, memory and communication go, per
// layer and per rank, and where the ranks differ. Every rank accumulates
// its own figures over the profiled steps (every step but the first, which
// warms up, unless the run has one step); at the end they travel to the
// writer, which writes profile.json and profile.txt (the per-layer table,
// the per-rank table, each group's collectives) and prints the table and
// the load-imbalance report: compute (per-stage and per-rank busy time),
// memory (per-rank peak by category) and communication (per-rank bytes and
// exposed time), each naming the rank and, past a threshold, a concrete
// change (a partition that moves a block, another micro-batch count, a
// checkpointing budget, a ZeRO stage).
//
// The report is computed from the figures alone (imbalance_report), so it
// is unit-tested on made-up profiles.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/comm/grid.h"
#include "loom/comm/parallel_context.h"
#include "loom/core/memory.h"
#include "loom/nn/context.h"
#include "loom/train/metrics.h"

namespace loom {

class StepEngine;
struct Config;

// One piece of a stage (the embeddings, a block, ln_f, the LM head) on one
// rank, per profiled step (means).
struct PieceProfile {
  std::string name;
  int64_t params = 0;  // elements this rank holds (GptStage::PieceSeconds)
  double flops = 0;    // model FLOPs of its forward and backward on this rank
  double forward = 0, backward = 0, recompute = 0;  // seconds
  // What it keeps from forward to backward for one micro-batch
  // (GptStage::piece_record_bytes), and the bytes it moves a step by a
  // model of the traffic: each micro-batch writes and reads that record and
  // reads the f32 parameters twice and reads and writes their gradients.
  double record_bytes = 0, bytes = 0;
  // Bytes this rank's collectives sent that were issued while the piece
  // ran (its tensor-parallel regions, all-to-alls, context ring, and the
  // ZeRO gathers and gradient reductions its unit's hooks started, a
  // prefetch of the next unit's with the piece that issued it), per step,
  // from the record of collectives: measured, not modelled.
  double comm_bytes = 0;
  double seconds() const { return forward + backward + recompute; }
};

// A chunk of blocks [first, last) of the model (one per virtual stage).
struct ChunkProfile {
  int first = 0, last = 0;
  std::vector<PieceProfile> pieces;
};

// One group's operations of one kind, per profiled step.
struct CommProfile {
  std::string group, kind;
  double ops = 0, bytes = 0, seconds = 0;
};

struct RankProfile {
  int rank = 0;  // grid rank
  GridCoord coord;
  std::string host;
  std::vector<ChunkProfile> chunks;
  std::vector<CommProfile> comm;
  // Per profiled step: the step, the optimizer, all communication and the
  // part of it nothing hid, the pipeline's bubble and this rank's bytes sent.
  double step_s = 0, optimizer_s = 0, comm_s = 0, exposed_s = 0, bubble_s = 0;
  double bubble_fraction = 0, comm_bytes = 0;
  std::array<double, kNumMemCategories> mem_peak{};  // bytes, the largest over the steps
  double compute_s() const;                          // its pieces' seconds
  double mem_total() const;
};

// What the report needs to know of the job.
struct JobShape {
  int tp = 1, pp = 1, dp = 1, ep = 1, virtual_stages = 1;
  int cp = 1;                                  // context parallel
  int64_t micro_batch = 1, micro_batches = 1;  // per rank and step
  int64_t seq_len = 0;
  std::string schedule;  // pipelined: the schedule; else ""
  int zero_stage = 0;
  bool overlap_comm = true;
  std::string recompute;       // activation_checkpointing's policy name
  std::vector<int> partition;  // blocks per part (pipelined)
  int64_t steps = 0;           // profiled
};

struct JobProfile {
  JobShape shape;
  std::vector<RankProfile> ranks;  // in grid order
};

nlohmann::json to_json(const JobProfile& p);
JobProfile job_profile_from_json(const nlohmann::json& j);

// Model FLOPs of one token's forward through piece `name` ("embeddings",
// "h.3", "ln_f", "lm_head") of the whole model (not a slice): the matrix
// products, attention's two over the full sequence as MFU counts them
// (GptStage::flops_per_token), a MoE block's k experts and router.
double piece_forward_flops(const GptConfig& m, const std::string& name);

// One line of the load-imbalance report.
struct Finding {
  std::string kind;        // "compute", "memory", "communication"
  double imbalance = 0;    // the largest rank's figure over the mean, minus one
  int rank = 0;            // the rank with the largest figure (grid rank)
  std::string detail;      // what differs, in numbers
  std::string suggestion;  // a change to try; empty when balanced
};
// Thresholds past which a finding carries a suggestion.
inline constexpr double kComputeImbalance = 0.10, kMemoryImbalance = 0.10, kCommImbalance = 0.25;
std::vector<Finding> imbalance_report(const JobProfile& p);
nlohmann::json to_json(const std::vector<Finding>& f);

// The per-layer table (per stage, the first rank holding it), as the end of
// a run prints it; profile_text adds the per-rank and per-group tables and
// the report.
std::string profile_table(const JobProfile& p);
std::string imbalance_text(const JobProfile& p, const std::vector<Finding>& f);
std::string profile_text(const JobProfile& p, const std::vector<Finding>& f);

// A step's imbalance across ranks from the figures gathered each step
// (metrics.jsonl's `imbalance` with log.profile): compute seconds, peak
// memory bytes and bytes sent per rank.
nlohmann::json step_imbalance(const std::vector<double>& compute, const std::vector<double>& mem,
                              const std::vector<double>& sent);

// One rank's accumulation over a run.
class RunProfiler {
 public:
  // steps: how many this process will run (the first is not profiled
  // unless it is the only one).
  // The engine's stages record their pieces' spans from now on.
  RunProfiler(const Config& config, int64_t steps, StepEngine& engine);
  // Drops what the stages timed since the last call (evaluation's forwards).
  void skip(StepEngine& engine);
  // Adds one training step: the stages' piece times, the step's figures
  // and this rank's memory peaks during it.
  void add(StepEngine& engine, const StepResult& r, const MemStats& mine);
  // Every rank's profile to the writer (collective over the world); others
  // get an empty profile.
  JobProfile gather(const ParallelContext& ctx, bool writer) const;

 private:
  const Config& config_;
  int64_t total_;
  bool warmed_ = false;
  int64_t steps_ = 0;
  RankProfile mine_;
};

}  // namespace loom
