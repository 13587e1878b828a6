// The run loop: the cadence around the step engine. It owns the data, the
// tokenizer, the run folder, evaluation, checkpoints, metrics, progress and
// the closing summary and sample; every optimizer step is the engine's.
#pragma once

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/parallel_context.h"
#include "loom/core/threads.h"
#include "loom/data/batch_source.h"
#include "loom/data/tokenizer.h"
#include "loom/kernels/cpu/cpu_backend.h"
#include "loom/profile/gemm_peak.h"
#include "loom/report/report.h"
#include "loom/train/checkpointer.h"
#include "loom/train/config.h"
#include "loom/train/gemm_choice.h"
#include "loom/train/metrics.h"
#include "loom/train/profile.h"
#include "loom/train/step_engine.h"
#include "loom/train/straggler.h"
#include "loom/train/trace.h"

namespace loom {

struct RunOptions {
  std::string out_dir;     // empty: write nothing (benchmarks)
  bool overwrite = false;  // allow a non-empty existing out_dir
  bool quiet = false;      // no progress output
  std::string resume;      // checkpoint folder or "latest"; "" starts fresh
  std::string init_from;   // Hugging Face GPT-2 safetensors to start from
  int restart = 0;         // loom launch: this run is restart number N, for this reason
  std::string restart_cause;
  // The rank grid and its groups (make_parallel_context); the default is
  // one process. World rank 0 alone writes the run folder, metrics,
  // checkpoints and progress.
  ParallelContext parallel;
  // Measure the machine's GEMM peak (the MFU denominator) again even when it
  // is cached, keeping the higher figure (machine_peak_gflops); benchmarks.
  bool remeasure_peak = false;
};

class Trainer {
 public:
  // Validates the data and the run folder before allocating; writes nothing.
  Trainer(Config config, RunOptions options, ThreadConfig threads);

  // Trains all configured steps, writing the run folder; returns the results.
  std::vector<StepResult> run();
  // One optimizer step (all micro-batches); no output.
  StepResult train_step();
  // Mean loss over train.eval_steps global validation batches (the same
  // samples every time and under every layout).
  double evaluate();
  // Samples n tokens after `prompt` (temperature 0: greedy), decoded to text.
  std::string sample(const std::string& prompt, int64_t n, double temperature, int64_t top_k,
                     uint64_t seed);

  const Config& config() const { return config_; }
  GptStage<float>& model() { return engine_->stage(); }
  ZeroEngine& zero() { return engine_->zero(); }
  StepEngine& engine() { return *engine_; }
  // The run's backend: the CPU's, or device cuda's (train/device.h).
  const Backend<float>& backend() const { return *backend_; }
  // The GEMMs' input type (f32, or the run's 16-bit type with
  // kernels.gemm_inputs 16bit) and the library that runs them ("onednn",
  // "openblas", "cublaslt").
  DType gemm_inputs() const { return gemm_inputs_; }
  const std::string& gemm_backend_name() const { return gemm_backend_name_; }
  // The whole flat parameter buffer (collective at ZeRO stage 3).
  std::vector<float> gather_params() { return engine_->gather_params(); }
  int64_t step() const { return step_; }
  // Saves a checkpoint of the current step into the checkpoint folder
  // (collective: every rank calls it). Sharded: every rank writes its own
  // file (in the background with checkpoint.async: run() completes it, or
  // finish_save()); whole: world rank 0 writes.
  void save(double lr);
  void finish_save();
  double peak_gflops() const { return peak_gflops_; }
  // The path the run's GEMMs take, whose peak peak_gflops() is.
  GemmPath gemm_path() const { return gemm_path_; }
  // Its name in metrics: "f32 sgemm", "bf16 matmul", "cublaslt f32", ...
  const std::string& gemm_path_name() const { return gemm_path_name_; }
  // The MFU denominator: the per-rank peak times the ranks, capped by the
  // cores they share on each host.
  double job_peak_gflops() const { return job_peak_gflops_; }

 private:
  void load_initial_state(uint64_t seed);
  // Every rank's compute and wait seconds of step `r` into it (collective
  // over the world), its straggler scores, and a warning when a rank turns
  // (or stops being) persistently slow.
  void gather_rank_times(StepResult& r);
  // log.profile: gathers every rank's profile, writes profile.json and
  // profile.txt and prints the table and the imbalance report (collective).
  void write_profile();
  // What a checkpoint of the current step records besides the tensors.
  TrainerState trainer_state(double lr) const;
  // checkpoint.format whole; return the folder (on the writer).
  std::string save_whole(double lr);
  // A model spread over stages or expert-parallel ranks: gathered tensor by
  // tensor (WholeModel).
  std::string save_pipelined(double lr);
  void open_run_folder();
  // log.report_every: report.html during the run (in the background, one
  // at a time, at most a tenth of the time), and the final page (`stopped`:
  // the error the run ended with).
  ReportOptions report_options(bool live, double step_seconds) const;
  void write_live_report(double step_seconds);
  void write_final_report(const std::string& stopped);
  std::vector<StepResult> run_steps();
  std::string checkpoint_root() const;
  void describe_run() const;
  void check_gemm_inputs_agree() const;
  void describe_zero() const;
  void describe_compression() const;
  void describe_checkpointing() const;

  Config config_;
  RunOptions options_;
  ThreadConfig threads_;
  GemmChoice gemm_;
  // The run's backend (kernels.gemm, kernels.gemm_inputs): every stage of
  // the engine computes on it. Declared before the engine, which it outlives.
  std::unique_ptr<Backend<float>> backend_;
  DType gemm_inputs_ = DType::kF32;
  std::string gemm_backend_name_, gemm_path_name_;
  // log.trace: the first steps' timeline (train/trace.h). Before the engine:
  // the stages' observers point at it.
  std::unique_ptr<RunTrace> trace_;
  uint64_t comm_dropped_ = 0;  // events the record lost (warned once)
  std::unique_ptr<StepEngine> engine_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<BatchSource> train_data_, val_data_;
  std::unique_ptr<Tokenizer> tokenizer_;  // null when the data's tokenizer is unknown
  bool writer_ = true;                    // world rank 0: writes outputs, shows progress
  double peak_gflops_ = 0;
  GemmPath gemm_path_ = GemmPath::kF32Sgemm;
  bool mfu_warned_ = false;
  bool compression_logged_ = false;  // the first compressed step is logged
  double job_peak_gflops_ = 0;
  std::unique_ptr<RunProfiler> profiler_;  // log.profile
  // The live page being written, and when the next may start (set by the
  // job, read after its get(); declared first, so the job ends before it goes).
  std::chrono::steady_clock::time_point report_next_{};
  std::future<void> report_job_;
  std::unique_ptr<StragglerDetector> stragglers_;
  std::vector<int> slow_ranks_;  // those last warned about
  int64_t step_ = 0;
  double resume_s_ = 0;  // verifying and reading the checkpoint resumed from (this rank)
  MetricsLog metrics_;
  std::unique_ptr<Progress> progress_;
};

}  // namespace loom
