// The single-process training loop: micro-batches with gradient accumulation,
// clipping, AdamW with a DeepSpeed schedule, periodic validation, metrics.jsonl
// and progress per DESIGN.md's output contract.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/core/threads.h"
#include "loom/nn/gpt.h"
#include "loom/optim/adamw.h"
#include "loom/parallel/zero/zero.h"
#include "loom/train/config.h"
#include "loom/data/batch_source.h"
#include "loom/data/tokenizer.h"

namespace loom {

struct RunOptions {
  std::string out_dir;     // empty: write nothing (benchmarks)
  bool overwrite = false;  // allow a non-empty existing out_dir
  bool quiet = false;      // no progress output
  std::string resume;      // checkpoint folder or "latest"; "" starts fresh
  std::string init_from;   // Hugging Face GPT-2 safetensors to start from
  // The data-parallel group (all ranks of an mpirun job); null: one process.
  // Rank 0 alone writes the run folder, metrics, checkpoints and progress.
  std::shared_ptr<ProcessGroup> dp_group;
};

struct StepResult {
  int64_t step = 0;  // 1-based
  double loss = 0, lr = 0, grad_norm = 0;
  double t_forward = 0, t_backward = 0, t_optimizer = 0, t_step = 0;  // seconds
  double tokens_per_s = 0, mfu = 0;
  std::optional<double> val_loss;
  double t_comm = 0, t_comm_exposed = 0, comm_bytes = 0;  // data-parallel communication
  MemStats mem;  // peaks: the maximum over ranks of each category
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
  Gpt<float>& model() { return model_; }
  ZeroEngine& zero() { return *zero_; }
  // The whole flat parameter buffer (gathered from the shards at ZeRO
  // stage 3: collective, every rank must call it).
  std::vector<float> gather_params();
  int64_t step() const { return step_; }
  double peak_gflops() const { return peak_gflops_; }

 private:
  void open_run_folder();
  std::string checkpoint_root() const;
  void save(double lr);
  bool sharded() const { return options_.dp_group && config_.zero.stage >= 1; }
  void describe_zero() const;
  MemStats peak_memory_over_ranks();
  void write_metrics(const StepResult& r);
  void show_progress(const StepResult& r, double elapsed, int64_t done);
  void print_summary(const std::vector<StepResult>& results, double elapsed);

  Config config_;
  RunOptions options_;
  ThreadConfig threads_;
  Gpt<float> model_;
  std::unique_ptr<ZeroEngine> zero_;  // optimizer, gradient reduction, sharding
  GptActivations<float> acts_;
  std::unique_ptr<BatchSource> train_data_, val_data_;
  std::unique_ptr<Tokenizer> tokenizer_;  // null when the data's tokenizer is unknown
  int dp_rank_ = 0, dp_size_ = 1;
  bool writer_ = true;  // rank 0: writes outputs, shows progress
  std::vector<int32_t> inputs_, targets_;
  double peak_gflops_ = 0;
  int64_t step_ = 0;
  std::ofstream metrics_;
  bool tty_ = false;
};

}  // namespace loom
