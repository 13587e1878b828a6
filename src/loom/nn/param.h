// Parameters as named views into flat buffers (DESIGN.md, principle 2): the
// optimizer, clipping, sharding and checkpoints all work on ranges of one
// buffer, and names (Hugging Face GPT-2 state-dict names) reach any element.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/tensor.h"

namespace loom {

// Which piece of the global tensor a rank holds: dim -1 means all of it.
struct Shard {
  int dim = -1;
  int index = 0;
  int count = 1;
};

struct Param {
  std::string name;    // "transformer.h.0.attn.c_attn.weight"
  Shape shape;         // global shape
  Shard shard;         // the piece stored here
  int64_t offset = 0;  // first element in the flat buffers
  int64_t numel = 0;   // elements stored here
  bool decay = false;  // weight decay applies (matrices and embeddings, not biases or norms)
  float init_std = 0;  // N(0, init_std); 0 means constant init_value
  float init_value = 0;
};

// The ordered list of parameters and their offsets in the flat buffers.
class ParamLayout {
 public:
  // Appends a parameter stored whole; returns its index.
  size_t add(std::string name, Shape shape, bool decay, float init_std, float init_value);
  const std::vector<Param>& params() const { return params_; }
  const Param& find(const std::string& name) const;  // throws with the name when missing
  int64_t total() const { return total_; }

 private:
  std::vector<Param> params_;
  int64_t total_ = 0;
};

}  // namespace loom
