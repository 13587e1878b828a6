// Sharded checkpoints ("loom checkpoint v2"): every rank writes the model
// state it holds to its own file, rank-NNNNN.safetensors, in parallel, and
// manifest.json names every tensor's global shape and the pieces the files
// hold of it. Nothing is gathered to save, and a rank that resumes reads
// only the pieces it needs.
//
// A piece is a contiguous range [begin, end) of a rank's slice of a tensor
// (its tensor-parallel ShardSpec of the global shape, flattened row-major):
// ZeRO cuts the flat buffers into ranges that start and end anywhere in a
// tensor. Tensors are named as in a whole checkpoint: the parameter's
// Hugging Face name, "exp_avg.<name>" and "exp_avg_sq.<name>".
//
// CheckpointReader reads either format (and a plain whole-tensor file such
// as a Hugging Face model.safetensors) into any layout: a range of a slice
// comes straight from the pieces of the same slicing when they cover it, and
// otherwise from the whole tensor assembled from all its pieces, one tensor
// at a time. So a checkpoint saved under one data-, tensor- or
// pipeline-parallel size and ZeRO stage loads under any other.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/io/safetensors.h"
#include "loom/nn/param.h"

namespace loom {

// "rank-00003.safetensors"
std::string shard_file_name(int rank);

// A piece this rank writes: elements [begin, end) of its slice of `param`.
struct PieceOut {
  std::string tensor;  // the name in the checkpoint
  const Param* param = nullptr;
  int64_t begin = 0, end = 0;
  const float* data = nullptr;  // end - begin elements
};

struct ShardFileInfo {
  size_t bytes = 0;
  std::string sha256;
};

// Writes `pieces` to `folder`/shard_file_name(rank), durable when it
// returns (fsynced and renamed into place). `on_half` runs once half of the
// pieces are written (the crash tests' fault point); `stop`, when set while
// it writes, abandons the file (Error, no file left).
ShardFileInfo write_shard_file(const std::string& folder, int rank,
                               const std::vector<PieceOut>& pieces,
                               const std::function<void()>& on_half = {},
                               const std::atomic<bool>* stop = nullptr);

// The manifest's "tensors" object built from the rank files' headers:
// {name: {"shape": [...], "pieces": [{"file", "shard", "range"}]}}.
nlohmann::json index_shard_files(const std::string& folder, int ranks);

nlohmann::json shard_spec_json(const ShardSpec& s);

class CheckpointReader {
 public:
  // A checkpoint folder, sharded or whole. Its manifest is read, not
  // verified (verify_checkpoint does that).
  explicit CheckpointReader(const std::string& dir);
  // A file of whole tensors (a whole checkpoint's model.safetensors, a
  // Hugging Face GPT-2 state dict).
  static CheckpointReader of_file(const std::string& path);
  ~CheckpointReader();
  CheckpointReader(CheckpointReader&&) noexcept;

  bool has(const std::string& tensor) const;
  // The stored global shape (the vocabulary of wte padded as the saving
  // layout padded it, or not at all in a whole file).
  const std::vector<int64_t>& shape(const std::string& tensor) const;
  // Elements [begin, end) of this rank's slice (p.shard) of `tensor`, whose
  // global shape here is p.shape, into dst. The stored shape must equal
  // p.shape but for the number of rows of transformer.wte.weight (and its
  // moments): rows beyond the stored ones are vocabulary padding, zero.
  void read(const std::string& tensor, const Param& p, int64_t begin, int64_t end,
            float* dst) const;
  // The element type `tensor` is stored in (its first piece's).
  DType stored_dtype(const std::string& tensor) const;
  const std::string& where() const { return where_; }

 private:
  CheckpointReader() = default;
  struct Piece {
    std::string file;
    ShardSpec shard;
    int64_t begin = 0, end = 0;
  };
  struct Tensor {
    std::vector<int64_t> shape;
    std::vector<Piece> pieces;
  };
  void add_whole_file(const std::string& path, const std::string& file);
  const Tensor& tensor(const std::string& name) const;
  const SafetensorsFile& file(const std::string& name) const;
  // The file's entry of piece `pc` of tensor `name`, checked against the piece.
  const SafetensorsEntry& entry(const std::string& name, const Piece& pc) const;
  // Elements [begin, end) of piece `pc` of tensor `name` (f32, f16 or bf16
  // in the file) converted into dst.
  void copy_piece(const std::string& name, const Piece& pc, int64_t begin, int64_t end,
                  float* dst) const;

  std::string dir_;    // the folder the files are in
  std::string where_;  // what errors name: the manifest or the file
  std::map<std::string, Tensor> tensors_;
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace loom
