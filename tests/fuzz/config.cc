// Fuzz target: the config parser with --set overrides. The input is a JSON
// text, then after a line "---" one override per line; world size 1-4 from
// the input's length.
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/train/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t cut = in.find("\n---\n");
  const std::string text = in.substr(0, cut);
  std::vector<std::string> overrides;
  if (cut != std::string::npos) {
    size_t at = cut + 5;
    while (at <= in.size()) {
      size_t nl = in.find('\n', at);
      if (nl == std::string::npos) nl = in.size();
      if (nl > at) overrides.push_back(in.substr(at, nl - at));
      at = nl + 1;
    }
  }
  try {
    loom::parse_config(text, "fuzz.json", overrides, static_cast<int>(size % 4) + 1);
  } catch (const loom::Error&) {
  }
  return 0;
}
