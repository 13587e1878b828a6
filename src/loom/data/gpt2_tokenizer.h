// GPT-2's byte-level BPE: the same pre-tokenisation pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (\s as JavaScript defines it, Unicode categories from ICU), the same
// byte-to-unicode table and merges, read from GPT-2's encoder.json and
// vocab.bpe. Bytes that are not valid UTF-8 are single-byte symbols of the
// "other" class, encoded through the byte table like any byte.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/data/tokenizer.h"

namespace loom {

class Gpt2Tokenizer : public Tokenizer {
 public:
  // `dir` holds encoder.json and vocab.bpe.
  explicit Gpt2Tokenizer(const std::string& dir);
  std::string name() const override { return "gpt2"; }
  uint32_t vocab_size() const override { return static_cast<uint32_t>(decoder_.size()); }
  std::vector<uint32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<uint32_t>& ids) const override;

  // The pre-tokens of `text` (byte ranges), as the pattern above splits it.
  static std::vector<std::string_view> pretokenize(std::string_view text);

 private:
  void bpe(std::string_view piece, std::vector<uint32_t>& out) const;

  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  std::vector<std::string> decoder_;  // id -> token text (byte-to-unicode form)
  uint32_t byte_id_[256] = {};        // id of each single byte
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> merges_;  // (a, b) -> (rank, ab)
  std::vector<int> unicode_to_byte_;  // code point -> byte, -1 if none
  mutable std::unordered_map<std::string, std::vector<uint32_t>, Hash, std::equal_to<>> cache_;
};

// The folder with GPT-2's encoder.json and vocab.bpe: $LOOM_GPT2_DIR, else the
// copy scripts/setup.sh fetches into the source tree's .cache/gpt2.
std::string gpt2_vocab_dir();

}  // namespace loom
