// Checkpoints: a folder per save, written under a temporary name, fsynced and
// renamed, so an interrupted save never damages an earlier checkpoint. Two
// formats share the folder's mechanics:
//   whole ("loom checkpoint v1"), written by one rank:
//     model.safetensors       Hugging Face GPT2LMHeadModel names and shapes (f32)
//     optimizer.safetensors   AdamW moments: exp_avg.<name>, exp_avg_sq.<name>
//   sharded ("loom checkpoint v2", sharded.h), written by every rank:
//     rank-NNNNN.safetensors  the pieces of the state that rank holds
// and in both
//   trainer_state.json      step, lr, loss scale, seed, data position, tokenizer
//   config.resolved.json    the run's config
//   manifest.json           size and SHA-256 of every file above (and, sharded,
//                           every tensor's shape and pieces)
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/model/gpt_stage.h"
#include "loom/optim/adamw.h"

namespace loom {

struct TrainerState {
  int64_t step = 0;  // optimizer steps completed
  double lr = 0;
  double loss_scale = 1.0;
  uint64_t seed = 0;
  std::string tokenizer;      // "" when the data had none (synthetic)
  int64_t skipped_steps = 0;  // steps whose update was skipped (non-finite gradients)
  // fp16's dynamic loss scaler (LossScaler::restore); iteration < 0: none.
  int64_t scaler_iteration = -1, scaler_last_overflow = -1;
  int scaler_hysteresis = 0;
};

// Assembles the whole tensor of a parameter split across ranks (tensor
// parallelism) from every rank's slice into the writing rank's `whole`
// (p.shape.numel() elements; null on the ranks that only contribute).
// Collective over the group that splits p: every rank of it calls it for the
// same parameters in the same order.
using AssembleFn = std::function<void(const Param& p, const float* slice, float* whole)>;

// Saves step `state.step` into `root`/step-NNNNNNNN, points `root`/latest at
// it, and removes all but the newest `keep_last` (0 keeps all). Returns the
// folder. exp_avg and exp_avg_sq are the AdamW moments laid out like the
// stage's flat parameter buffer (not a ZeRO shard), or null to write none.
// Every tensor is written whole, one at a time: a split one is assembled by
// `assemble` just before; the ranks that share the assembling but do not
// write pass write = false and take part in the same calls.
std::string save_checkpoint(const std::string& root, const GptStage<float>& model,
                            const float* exp_avg, const float* exp_avg_sq,
                            const TrainerState& state, const nlohmann::json& config,
                            int64_t keep_last, const AssembleFn& assemble = {}, bool write = true);

// The folder mechanics of a save, for a save written by several ranks:
// begin_checkpoint (one rank) makes the empty temporary folder of step
// `step` under `root` and returns it; the ranks write their files into it;
// finish_checkpoint (the same rank, once every file is durable) writes
// trainer_state.json, config.resolved.json and manifest.json (`manifest`
// with the files listed, and their sizes and hashes: `files` names those
// already written), puts the folder in place, moves `latest` and prunes to
// `keep_last` (0 keeps all). Returns the checkpoint's folder.
std::string checkpoint_staging_folder(const std::string& root, int64_t step);
std::string begin_checkpoint(const std::string& root, int64_t step);
std::string finish_checkpoint(const std::string& root, const TrainerState& state,
                              const nlohmann::json& config, nlohmann::json manifest,
                              int64_t keep_last);

// Fault injection for the crash-safety tests: LOOM_TEST_FAULT=PHASE@STEP
// (world rank 0) or PHASE@STEP:RANK kills the process (SIGKILL, as a crash
// would) when rank RANK's save of step STEP reaches PHASE: `partial` (its
// tensor file half written), `rename` (every file durable in the temporary
// folder, before it is put in place) or `pointer` (the folder in place,
// before `latest` moves). Tests only.
void checkpoint_fault_point(const char* phase, int64_t step, int rank = 0);

// A checkpoint folder, or `root` + "/latest" resolved through the pointer file.
std::string resolve_checkpoint(const std::string& dir_or_latest, const std::string& root);

// Verifies the manifest (every file present, sizes and SHA-256 equal).
// With parts > 1 the structure is checked whole but only the files i with
// i % parts == part are read and hashed: the ranks of a resumed run share
// the reading.
void verify_checkpoint(const std::string& dir, int part = 0, int parts = 1);

nlohmann::json read_checkpoint_config(const std::string& dir);
// The model's shape from a checkpoint's config.resolved.json.
GptConfig read_checkpoint_model(const std::string& dir);

// Writes checkpoint `dir` (either format, saved under any layout) as a whole
// one into the new folder `out`: model.safetensors with Hugging Face
// GPT2LMHeadModel names and shapes, optimizer.safetensors with whole moments
// (when `dir` has them), its trainer state and config, and a manifest, so
// `out` resumes like `dir` and its model.safetensors loads anywhere. One
// tensor is in memory at a time. Returns the number of tensors written.
int64_t consolidate_checkpoint(const std::string& dir, const std::string& out);
TrainerState read_trainer_state(const std::string& dir);

// Loads parameters (and the moments, into buffers laid out like the stage's
// flat parameters, when given) of either format after verifying; shapes
// must match the model. A split parameter takes its slice of the whole
// tensor and a pipeline stage the parameters it holds (a last stage's wte
// copy from transformer.wte.weight), so a checkpoint loads under any
// layout. Returns the trainer state.
TrainerState load_checkpoint(const std::string& dir, GptStage<float>& model,
                             float* exp_avg = nullptr, float* exp_avg_sq = nullptr);

// Loads Hugging Face GPT-2 weights (f32, f16 or bf16) from a safetensors file
// into `model`, checking the file's shapes against the config's keys.
void load_hf_weights(const std::string& path, GptStage<float>& model);
// The config check of load_hf_weights alone (model.n_layer, n_embd,
// vocab_size and seq_len against the file's tensors).
void check_hf_weights(const std::string& path, const GptConfig& config);

}  // namespace loom
