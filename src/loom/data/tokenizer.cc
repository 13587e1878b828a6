#include "loom/data/tokenizer.h"

#include "loom/core/error.h"
#include "loom/data/gpt2_tokenizer.h"

namespace loom {

namespace {
class ByteTokenizer : public Tokenizer {
 public:
  std::string name() const override { return "byte"; }
  uint32_t vocab_size() const override { return 256; }
  std::vector<uint32_t> encode(std::string_view text) const override {
    std::vector<uint32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::string s;
    s.reserve(ids.size());
    for (uint32_t id : ids) {
      LOOM_CHECK_KIND(kData, id < 256, "token id {} is beyond the byte vocabulary (256)", id);
      s.push_back(static_cast<char>(id));
    }
    return s;
  }
};
}  // namespace

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name) {
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  if (name == "gpt2") return std::make_unique<Gpt2Tokenizer>(gpt2_vocab_dir());
  LOOM_FAIL(kConfig, "unknown tokenizer '{}' (expected byte or gpt2)", name);
}

}  // namespace loom
