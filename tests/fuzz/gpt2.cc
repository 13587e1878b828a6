// Fuzz target: the GPT-2 tokenizer. The input is encoded as text, decoded
// back (which must give the text again: byte-level BPE is lossless), and
// also read as token ids (little-endian 16-bit) and decoded.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/data/gpt2_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const loom::Gpt2Tokenizer tok(loom::gpt2_vocab_dir());
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<uint32_t> ids = tok.encode(text);
  for (uint32_t id : ids)
    if (id >= tok.vocab_size()) std::abort();
  if (tok.decode(ids) != text) std::abort();
  std::vector<uint32_t> raw;
  for (size_t i = 0; i + 1 < size; i += 2) raw.push_back(data[i] | (uint32_t{data[i + 1]} << 8));
  try {
    tok.decode(raw);
  } catch (const loom::Error&) {
  }
  return 0;
}
