// Checkpoints: a folder per save, written under a temporary name, fsynced and
// renamed, so an interrupted save never damages an earlier checkpoint.
//   model.safetensors       Hugging Face GPT2LMHeadModel names and shapes (f32)
//   optimizer.safetensors   AdamW moments: exp_avg.<name>, exp_avg_sq.<name>
//   trainer_state.json      step, lr, loss scale, seed, data position, tokenizer
//   config.resolved.json    the run's config
//   manifest.json           size and SHA-256 of every file above
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
  std::string tokenizer;  // "" when the data had none (synthetic)
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

// A checkpoint folder, or `root` + "/latest" resolved through the pointer file.
std::string resolve_checkpoint(const std::string& dir_or_latest, const std::string& root);

// Verifies the manifest (every file present, sizes and SHA-256 equal).
void verify_checkpoint(const std::string& dir);

nlohmann::json read_checkpoint_config(const std::string& dir);
TrainerState read_trainer_state(const std::string& dir);

// Loads parameters (and the moments, into buffers laid out like the stage's
// flat parameters, when given) after verifying; shapes must match the model.
// A split parameter takes its slice of the whole tensor and a pipeline
// stage the parameters it holds (a last stage's wte copy from
// transformer.wte.weight), so a checkpoint loads under any tensor- and
// pipeline-parallel size. Returns the trainer state.
TrainerState load_checkpoint(const std::string& dir, GptStage<float>& model,
                             float* exp_avg = nullptr, float* exp_avg_sq = nullptr);

// Loads Hugging Face GPT-2 weights (f32, f16 or bf16) from a safetensors file
// into `model`, checking the file's shapes against the config's keys.
void load_hf_weights(const std::string& path, GptStage<float>& model);

}  // namespace loom
