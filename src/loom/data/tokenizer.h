// Tokenizers turn text into model token ids and back.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;
  virtual uint32_t vocab_size() const = 0;
  virtual std::vector<uint32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<uint32_t>& ids) const = 0;
};

// "byte": each byte of the UTF-8 text is a token (vocabulary 256).
// "gpt2": GPT-2's byte-level BPE (vocabulary 50257), files from gpt2_vocab_dir().
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name);

}  // namespace loom
