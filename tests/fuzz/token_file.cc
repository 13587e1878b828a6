// Fuzz target: token files (the header and the body it claims). Every
// token of an accepted file is read.
#include <cstdint>

#include "fuzz_util.h"
#include "loom/core/error.h"
#include "loom/data/token_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = loom::fuzz::scratch("x.tokens");
  loom::fuzz::write(path, data, size);
  try {
    loom::TokenFile t(path);
    uint64_t sum = 0;
    for (uint64_t i = 0; i < t.size(); ++i) sum += t[i];
    volatile uint64_t keep = sum;
    (void)keep;
  } catch (const loom::Error&) {
  }
  return 0;
}
