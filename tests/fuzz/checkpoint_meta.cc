// Fuzz target: a checkpoint folder's manifest.json and trainer_state.json
// (the input split at its first NUL byte), verified and read as a resume
// does, beside small well-formed files the manifest may list.
#include <cstdint>
#include <filesystem>
#include <string>

#include "fuzz_util.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const std::string dir = [] {
    std::string d = loom::fuzz::scratch("checkpoint");
    fs::create_directories(d);
    for (const char* f : {"model.safetensors", "config.resolved.json", "optimizer.safetensors"}) {
      const uint8_t body[] = {'{', '}'};
      loom::fuzz::write(d + "/" + f, body, sizeof body);
    }
    return d;
  }();
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t cut = in.find('\0');
  const std::string manifest = in.substr(0, cut);
  const std::string state = cut == std::string::npos ? std::string() : in.substr(cut + 1);
  loom::fuzz::write(dir + "/manifest.json", reinterpret_cast<const uint8_t*>(manifest.data()),
                    manifest.size());
  loom::fuzz::write(dir + "/trainer_state.json", reinterpret_cast<const uint8_t*>(state.data()),
                    state.size());
  try {
    loom::verify_checkpoint(dir);
  } catch (const loom::Error&) {
  }
  try {
    loom::read_trainer_state(dir);
  } catch (const loom::Error&) {
  }
  try {
    loom::read_checkpoint_config(dir);
  } catch (const loom::Error&) {
  }
  return 0;
}
