// Fuzz target: the safetensors reader. Every tensor it accepts is read
// through (the sanitizers catch a read outside the file).
#include <cstdint>

#include "fuzz_util.h"
#include "loom/core/error.h"
#include "loom/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = loom::fuzz::scratch("x.safetensors");
  loom::fuzz::write(path, data, size);
  try {
    loom::SafetensorsFile f(path);
    unsigned sum = 0;
    for (const loom::SafetensorsEntry& e : f.entries())
      for (size_t i = 0; i < e.bytes; ++i) sum += static_cast<const unsigned char*>(e.data)[i];
    volatile unsigned keep = sum;
    (void)keep;
  } catch (const loom::Error&) {
  }
  return 0;
}
