// The whole model's tensors, whatever the layout: each parameter (and AdamW
// moment) of a model spread over ZeRO shards, tensor-parallel slices,
// pipeline stages and chunks (and experts over expert-parallel ranks), as
// its whole tensor on every rank of a replica. Checkpoints of a pipelined run and the
// layout-equivalence harness read the model through it.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/train/step_engine.h"

namespace loom {

class WholeModel {
 public:
  enum Kind { kParam, kExpAvg, kExpAvgSq, kGrad };
  // Collective over the world: gathers ZeRO shards (and the moments, or the
  // reduced gradients, when asked) into each chunk; the destructor releases
  // them.
  WholeModel(StepEngine& engine, bool moments, bool grads = false);
  ~WholeModel();
  WholeModel(const WholeModel&) = delete;
  WholeModel& operator=(const WholeModel&) = delete;

  // The whole model's parameters: names, global shapes (wte with its padded
  // vocabulary) and offsets of a one-process flat buffer.
  const ParamLayout& layout() const { return whole_->layout(); }
  // p (of layout()) whole into out (p.shape.numel() elements) on every rank
  // of this replica. Collective over the tensor- and pipeline-parallel
  // groups: every rank asks for the same tensors in the same order.
  void get(const Param& p, Kind kind, float* out);
  // Every parameter, by name, the vocabulary without padding (collective).
  std::map<std::string, std::vector<float>> params_by_name();
  // The same for the reduced gradients (made with grads = true).
  std::map<std::string, std::vector<float>> grads_by_name();

 private:
  // The rank of the expert-parallel group holding parameter `name`: -1 for
  // a parameter every rank of it holds.
  int expert_holder(const std::string& name) const;
  struct Owner {
    int stage = 0, chunk = 0;
  };
  StepEngine& engine_;
  std::unique_ptr<GptStage<float>> whole_;  // layout only
  std::map<std::string, Owner> owner_;
  std::vector<std::vector<float>> m_, v_, g_;  // per chunk, laid out like its flat parameters
  std::map<std::string, std::vector<float>> by_name(Kind kind);
  std::vector<bool> was_gathered_;
};

}  // namespace loom
