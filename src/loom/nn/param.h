// Parameters as named views into flat buffers (DESIGN.md, principle 2): the
// optimizer, clipping, sharding and checkpoints all work on ranges of one
// buffer, and names (Hugging Face GPT-2 state-dict names) reach any element.
// Layers declare their parameters through ParamLayout::add, the one builder;
// each gets a ParamId that the layer keeps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/shape.h"

namespace loom {

// Which slice of the global tensor a rank stores (tensor parallelism splits a
// weight among `count` ranks; this rank holds piece `index`).
//   kWhole  the whole tensor.
//   kDim    equal contiguous pieces along dimension `dim` (a row split when
//           dim is 0, a column split, not one contiguous range, when it is 1).
//   kHeads  dimension `dim` is `blocks` equal blocks side by side (the fused
//           q | k | v of c_attn), and each block is split into `count`
//           pieces: rank r holds piece r of every block, so it keeps whole
//           attention heads.
//   kVocab  rows (dimension 0) split into equal ranges of the padded
//           vocabulary; the rows at or beyond `valid_rows` are padding.
struct ShardSpec {
  enum Kind { kWhole, kDim, kHeads, kVocab };
  Kind kind = kWhole;
  int dim = 0;
  int index = 0, count = 1;
  int blocks = 1;  // kHeads

  static ShardSpec whole() { return {}; }
  static ShardSpec split(int dim, int index, int count) { return {kDim, dim, index, count, 1}; }
  static ShardSpec heads(int dim, int index, int count, int blocks = 3) {
    return {kHeads, dim, index, count, blocks};
  }
  static ShardSpec vocab(int index, int count) { return {kVocab, 0, index, count, 1}; }
  bool sharded() const { return kind != kWhole && count > 1; }
  std::string describe() const;  // "whole", "dim 1 piece 0/2", ...
};

// The shape of the slice `spec` takes of `global`; throws when the split
// dimension does not divide evenly.
Shape shard_shape(const Shape& global, const ShardSpec& spec);
// The global flat index (row-major) of local element `i` of the slice.
int64_t shard_global_index(const Shape& global, const ShardSpec& spec, int64_t i);
// Copies between a slice and the whole tensor: local (shard_shape) <->
// global (`global`, row-major). Checkpoints assemble whole tensors from the
// ranks' slices with to_global and hand each rank its slice with from_global.
template <typename T>
void shard_to_global(const Shape& global, const ShardSpec& spec, const T* local, T* whole);
template <typename T>
void shard_from_global(const Shape& global, const ShardSpec& spec, const T* whole, T* local);

struct ParamId {
  int index = -1;
  bool valid() const { return index >= 0; }
};

// How a parameter is initialised: every element from (seed, name, global
// element index), so a slice holds exactly the elements of the whole tensor.
struct ParamInit {
  float std = 0;  // N(0, std); 0 means the constant `value`
  float value = 0;
  int64_t valid_rows = -1;  // rows at or beyond it (vocabulary padding) stay 0; -1: all rows
};

struct Param {
  std::string name;    // "transformer.h.0.attn.c_attn.weight"
  Shape shape;         // global shape
  ShardSpec shard;     // the slice stored here
  Shape local;         // its shape
  int64_t offset = 0;  // first element in the flat buffers
  int64_t numel = 0;   // elements stored here (local.numel())
  int unit = 0;        // the unit (see ParamLayout) it belongs to
  bool decay = false;  // weight decay applies (matrices and embeddings, not biases or norms)
  ParamInit init;
  // Where it sits in its unit's widened copy when the run's matrices are
  // read in 16 bits (ParamStore::bind_params16); -1: a matrix, read so.
  int64_t widened = -1;
  bool matrix() const { return local.rank() == 2; }
};

// A contiguous range of the flat buffers holding the parameters that are used
// together (the embeddings, one transformer block, the final norm). ZeRO
// shards, gathers and reduces unit by unit: each unit's size is a multiple of
// the layout's unit_multiple, so it splits into equal slices.
//
// An expert unit (a mixture-of-experts layer's experts, those this rank
// holds) rides on its block's unit, its `host`: every use of the host uses
// it too (ZeRO gathers, binds and reduces both), and under expert
// parallelism its gradients are reduced over the ranks holding the same
// experts rather than over the whole data-parallel group.
struct Unit {
  std::string name;  // "embeddings", "h.3", "ln_f", "h.3.experts"
  int64_t begin = 0, end = 0;
  int host = -1;        // an expert unit's host unit; -1: a dense unit
  int64_t widened = 0;  // elements of its parameters that are not matrices (aligned as above)
  int64_t size() const { return end - begin; }
  bool expert() const { return host >= 0; }
};

// The ordered list of parameters and their offsets in the flat buffers.
class ParamLayout {
 public:
  // unit_multiple: every unit's size is padded up to a multiple of it.
  explicit ParamLayout(int64_t unit_multiple = 1) : unit_multiple_(unit_multiple) {}
  // Opens a unit and returns its index; parameters added until the next
  // begin_unit() belong to it.
  int begin_unit(std::string name);
  // Opens an expert unit riding on the unit open now (see Unit).
  int begin_expert_unit(std::string name);
  // Appends a parameter (its slice `shard` of the global `shape`) to the open unit.
  ParamId add(std::string name, Shape shape, bool decay, ParamInit init,
              ShardSpec shard = ShardSpec::whole());
  // Pads the open unit by n elements (aligned as a parameter would be) that
  // belong to no parameter.
  void reserve(int64_t n);
  const std::vector<Param>& params() const { return params_; }
  const Param& operator[](ParamId id) const { return params_[static_cast<size_t>(id.index)]; }
  const std::vector<Unit>& units() const { return units_; }
  int unit_index(const std::string& name) const;     // -1 when there is none
  const Param& find(const std::string& name) const;  // throws with the name when missing
  const Param* find_or_null(const std::string& name) const;
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
