// Fuzz target: the GPT-2 tokenizer's own files. The input is encoder.json
// and vocab.bpe (split at the first NUL byte); either the tokenizer loads,
// and then encoding a text and decoding it gives the text back, or loading
// is an error that names the file.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "loom/core/error.h"
#include "loom/data/gpt2_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    std::string d = loom::fuzz::scratch("gpt2_files");
    std::filesystem::create_directories(d);
    return d;
  }();
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t cut = in.find('\0');
  const std::string enc = in.substr(0, cut);
  const std::string bpe = cut == std::string::npos ? std::string() : in.substr(cut + 1);
  loom::fuzz::write(dir + "/encoder.json", reinterpret_cast<const uint8_t*>(enc.data()),
                    enc.size());
  loom::fuzz::write(dir + "/vocab.bpe", reinterpret_cast<const uint8_t*>(bpe.data()), bpe.size());
  try {
    const loom::Gpt2Tokenizer tok(dir);
    const std::string text = "Hello there, it's 2026: caf\xc3\xa9 \xff\xfe  ok\n";
    const std::vector<uint32_t> ids = tok.encode(text);
    for (uint32_t id : ids)
      if (id >= tok.vocab_size()) std::abort();
    if (tok.decode(ids) != text) std::abort();
  } catch (const loom::Error&) {
  }
  return 0;
}
