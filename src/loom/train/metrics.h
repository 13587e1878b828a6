// What a run reports per optimizer step: metrics.jsonl (DESIGN.md's output
// contract; scripts read it, never the terminal) and the terminal progress.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/record.h"
#include "loom/core/memory.h"

namespace loom {

// One mixture-of-experts layer over a step's global batch (every rank's
// forwards; evaluation excluded).
struct MoeLayerStats {
  int layer = 0;             // the block's global index
  double imbalance = 0;      // the busiest expert's assignments over the mean
  double cv = 0;             // coefficient of variation of the experts' assignments
  double dropped = 0;        // share of assignments dropped at capacity
  double aux = 0, z = 0;     // the balancing losses, mean over micro-batches
  std::vector<double> load;  // each expert's share of the assignments
};

struct StepResult {
  int64_t step = 0;  // 1-based
  double loss = 0, lr = 0, grad_norm = 0;
  int64_t skipped_steps = 0;  // so far in the run (non-finite gradients, train.on_nonfinite skip)
  double loss_scale = 1;      // fp16: the scale the step's backward ran with
  bool fp16 = false;          // fp16.enabled: skips are overflows
  double t_forward = 0, t_backward = 0, t_recompute = 0, t_optimizer = 0, t_step = 0;  // seconds
  double tokens_per_s = 0, mfu = 0;
  std::optional<double> val_loss;
  double t_comm = 0, t_comm_exposed = 0;  // all communication
  // Bytes this rank sent in the step, and per group, from the record of
  // every operation (comm/record.h).
  double comm_bytes = 0;
  std::vector<CommTotals> comm_groups;
  std::vector<CommEvent> comm_events;  // the step's operations (not written to metrics.jsonl)
  // comm.compression or a 1-bit optimizer (none: not written): whether the
  // step's data-parallel reduction ran compressed, the bytes it sent
  // against what the plain reduction would have sent (compression.h), and
  // this rank's error-feedback norm after the step.
  std::string compression;
  bool compressed = false;
  bool local_step = false;  // 0/1 Adam: a local step (nothing sent)
  double compressed_bytes = 0, uncompressed_bytes = 0, error_norm = 0;
  double t_all_to_all = 0;  // of it, the MoE layers' all-to-alls (expert parallelism)
  // Context parallelism (parallel.context > 1): this rank's seconds in the
  // keys' and values' collectives and the part of them waited for (the rest
  // ran beside the attention), and every rank's seconds in the attention
  // kernels, in grid order (the causal balance).
  bool context = false;
  double t_context_comm = 0, t_context_exposed = 0;
  int64_t context_sent_bytes = 0;
  std::vector<double> context_attention;
  // Pipelined: seconds the most idle stage waited in the schedule, that
  // stage's idle share, and seconds this rank blocked on pipeline messages.
  double t_bubble = 0, bubble_fraction = 0, t_p2p_wait = 0;
  std::string gemm_backend;  // kernels.gemm in effect
  std::string gemm_path;     // the path the GEMMs take: "f32 sgemm" or "bf16 matmul"
  double peak_gflops = 0;    // the MFU denominator: that path's peak
  MemStats mem;              // peaks: the maximum over ranks of each category
  std::vector<MoeLayerStats> moe;
  // Per rank, in grid order (parallel jobs): seconds computing (the step
  // less the time waiting on communication) and waiting, and the straggler
  // score (straggler.h).
  std::vector<double> rank_compute, rank_wait, rank_score;
  // log.profile: per rank its peak memory (all categories) and bytes sent
  // in the step; metrics.jsonl then has the step's `imbalance`.
  std::vector<double> rank_mem, rank_sent;
  // The first step after `loom launch` restarted the job: which restart,
  // why, and on how many ranks it runs now.
  int restart = 0;
  std::string restart_cause;
  int world = 1;
};

// metrics.jsonl: one JSON object per step.
class MetricsLog {
 public:
  // Opens `path`, keeping the lines of steps <= keep_through (a resumed run
  // keeps what its checkpoint covers and drops what came after).
  void open(const std::string& path, int64_t keep_through);
  void write(const StepResult& r);

 private:
  std::ofstream out_;
};

// Rank 0's terminal: a bar on a terminal, a line every log.every steps
// otherwise, and the closing summary.
class Progress {
 public:
  Progress(int64_t total_steps, int64_t every, bool quiet, bool tty)
      : total_(total_steps), every_(every), quiet_(quiet), tty_(tty) {}
  bool quiet() const { return quiet_; }
  bool tty() const { return tty_; }
  void show(const StepResult& r, double elapsed, int64_t done) const;
  // "done in 2m31s: loss 5.5 -> 2.1 (val 2.2), median N tokens/s, MFU ..."
  void summary(const std::vector<StepResult>& results, double elapsed, double peak_gflops,
               const std::string& out_dir) const;

 private:
  int64_t total_, every_;
  bool quiet_, tty_;
};

std::string format_duration(double seconds);  // "2m05s", "1h03m"

}  // namespace loom
