// The run configuration: one JSON file, DeepSpeed's keys where DeepSpeed has
// them, loom's own sections otherwise (DESIGN.md, Configuration). Every key
// is checked against a schema: unknown keys get a did-you-mean, wrong types
// and ranges name the key path, and the batch identity is enforced.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/model/gpt_stage.h"
#include "loom/model/recompute.h"
#include "loom/optim/adamw.h"
#include "loom/optim/loss_scaler.h"
#include "loom/optim/lr_schedule.h"
#include "loom/parallel/zero/zero_config.h"

namespace loom {

struct DataConfig {
  std::string train, val;  // token files; empty with synthetic
  bool synthetic = false;
  std::string sampling = "random";  // random | sequential (epoch-style)
};

struct TrainConfig {
  std::string name = "run";
  int64_t steps = 100;
  uint64_t seed = 1234;
  int64_t eval_every = 0;  // 0: never
  int64_t eval_steps = 10;
  int64_t sample_tokens = 0;  // print a sample of this many tokens at the end
  std::string sample_prompt;
  double sample_temperature = 0.8;
  int64_t sample_top_k = 40;
  // A step whose gradients hold inf or NaN: stop (naming the first such
  // parameter) or skip its update.
  std::string on_nonfinite = "stop";
};

struct CheckpointConfig {
  std::string dir;        // "" : <run folder>/checkpoints
  int64_t every = 0;      // save every this many steps and at the end; 0: never
  int64_t keep_last = 0;  // keep the newest this many; 0: all
  // sharded: every rank writes what it holds (checkpoint/sharded.h);
  // whole: one rank writes whole Hugging Face tensors.
  std::string format = "sharded";
  bool async = false;  // sharded: write in the background while training goes on
};

// kernels: which GEMM backend runs the f32 matrix products.
struct KernelsConfig {
  std::string gemm = "auto";  // auto | onednn | openblas
  // auto | f32 | 16bit: in a bf16/fp16 run, whether GEMMs round their
  // inputs to the run's 16-bit type (cpu::gemm_16) or multiply the f32
  // values as given; resolved at load (train/gemm_choice.h) into gemm16,
  // with the reason in words.
  std::string gemm_inputs = "auto";
  bool gemm16 = false;
  std::string gemm_inputs_why;
  bool tf32 = false;  // device cuda: f32 GEMMs may use TF32 tensor cores
};

struct LogConfig {
  int64_t every = 1;
  bool trace = false;        // write trace.json: the first steps' timeline (train/trace.h)
  bool profile = false;      // per-layer profile and imbalance report (train/profile.h)
  double peak_gflops = 0;    // the MFU denominator; 0: measured at start
  int64_t report_every = 0;  // rewrite report.html every N steps (0: never)
};

// parallel.*: the rank grid. dp = world / (tensor x context x pipeline).
struct ParallelConfig {
  int tensor = 1, pipeline = 1, expert = 1;
  // Context parallelism: each sequence cut into 2 x context chunks, rank r of
  // the context group holding chunks r and 2 x context - 1 - r; the
  // attention's keys and values cross the group by context_comm ("p2p": a
  // ring overlapped with the attention, "all_gather", "a2a": all-to-all to
  // whole sequences for a share of the heads).
  int context = 1;
  std::string context_comm = "p2p";
  bool context_balance = true;  // false: rank r holds chunks 2r and 2r + 1 (one contiguous piece)
  bool sequence_parallel = false;  // LayerNorm and dropout regions split along the sequence
  // Pipeline: the schedule, chunks per stage (interleaved), and how the
  // blocks are cut into the pipeline x virtual_stages parts: "uniform",
  // "balanced" (measured), or "list" with the layer counts given.
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  std::string partition = "uniform";
  std::vector<int> partition_counts;  // partition == "list"
  int64_t stage_memory_bytes = 0;     // balanced: no part above it (0: no limit)
};

// activation_checkpointing: loom's policy, and DeepSpeed's keys (accepted;
// what each does here is logged at start and listed in docs/config.md).
struct CheckpointingConfig {
  CheckpointPolicy policy;
  std::string activation_dtype = "auto";  // auto: the run's precision; f32
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  int64_t number_checkpoints = 0;  // 0: not given
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
  bool deepspeed_keys = false;  // any of the above was given
};

struct Config {
  GptConfig model;
  std::string device = "cpu";  // cpu | cuda (train/device.h)
  // bf16.enabled / fp16.enabled: parameters and gradients in 16 bits with
  // f32 masters (kF32: neither).
  DType precision = DType::kF32;
  // fp16's dynamic loss scaling (DeepSpeed's keys and defaults).
  LossScaleConfig loss_scaling;
  int64_t train_batch_size = 0;
  int64_t micro_batch = 0;  // train_micro_batch_size_per_gpu
  int64_t grad_accum = 0;   // gradient_accumulation_steps
  int64_t data_parallel = 1;
  ParallelConfig parallel;
  // The tokens of each sequence one rank holds: seq_len / parallel.context.
  int64_t local_seq_len() const { return model.seq_len / parallel.context; }
  CheckpointingConfig checkpointing;
  double gradient_clipping = 0.0;  // 0: off
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  DataConfig data;
  TrainConfig train;
  CheckpointConfig checkpoint;
  ZeroConfig zero;
  CommOptions comm;
  LogConfig log;
  KernelsConfig kernels;
  nlohmann::json resolved;  // every key with its value in effect
};

// Parses `text` (named `source` in messages), applies `overrides`
// ("section.key=value", value parsed as JSON when it parses, else a string),
// validates against the schema and resolves defaults and the batch identity
// for `world_size` data-parallel ranks. Throws Error(kConfig) with a one-line
// message naming the key or file.
Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides, int world_size = 1);
Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   int world_size = 1);
// The comm.* keys alone from "--set comm.key=value" items (tools that run
// no model: `loom bench comm`), checked and defaulted by the same table.
CommOptions comm_options_from(const std::vector<std::string>& overrides);

}  // namespace loom
