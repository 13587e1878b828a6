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
  int unit = 0;        // the unit (see ParamLayout) it belongs to
  bool decay = false;  // weight decay applies (matrices and embeddings, not biases or norms)
  float init_std = 0;  // N(0, init_std); 0 means constant init_value
  float init_value = 0;
};

// A contiguous range of the flat buffers holding the parameters that are used
// together (the embeddings, one transformer layer, the final norm). ZeRO
// shards, gathers and reduces unit by unit: each unit's size is a multiple of
// the layout's unit_multiple, so it splits into equal slices.
struct Unit {
  std::string name;  // "embeddings", "h.3", "ln_f"
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

// The ordered list of parameters and their offsets in the flat buffers.
class ParamLayout {
 public:
  // unit_multiple: every unit's size is padded up to a multiple of it.
  explicit ParamLayout(int64_t unit_multiple = 1) : unit_multiple_(unit_multiple) {}
  // Opens a unit; parameters added until the next begin_unit() belong to it.
  void begin_unit(std::string name);
  // Appends a parameter stored whole to the open unit; returns its index.
  size_t add(std::string name, Shape shape, bool decay, float init_std, float init_value);
  const std::vector<Param>& params() const { return params_; }
  const std::vector<Unit>& units() const { return units_; }
  const Param& find(const std::string& name) const;  // throws with the name when missing
  // Elements of the flat buffers: parameters, alignment and unit padding.
  int64_t total() const { return total_; }
  // Elements of the parameters alone (what a user calls the parameter count).
  int64_t numel() const;

 private:
  int64_t unit_multiple_;
  std::vector<Param> params_;
  std::vector<Unit> units_;
  int64_t next_ = 0;   // where the next parameter goes
  int64_t total_ = 0;  // the end of the last unit
};

}  // namespace loom
