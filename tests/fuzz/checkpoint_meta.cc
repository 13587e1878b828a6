// Fuzz target: a checkpoint folder's manifest.json and trainer_state.json
// (the input split at its first NUL byte), verified and read as a resume
// does, beside small well-formed files the manifest may list: a sharded
// checkpoint's pieces (rank-00000.safetensors holds the first column half of
// a 6 x 8 tensor) are read into a column slice and into the whole tensor.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/sharded.h"
#include "loom/core/error.h"

namespace {
loom::Param param(loom::ShardSpec s) {
  loom::Param p;
  p.name = "transformer.h.0.mlp.c_fc.weight";
  p.shape = loom::Shape{6, 8};
  p.shard = s;
  p.local = loom::shard_shape(p.shape, s);
  p.numel = p.local.numel();
  return p;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const std::string dir = [] {
    std::string d = loom::fuzz::scratch("checkpoint");
    fs::create_directories(d);
    for (const char* f : {"model.safetensors", "config.resolved.json", "optimizer.safetensors"}) {
      const uint8_t body[] = {'{', '}'};
      loom::fuzz::write(d + "/" + f, body, sizeof body);
    }
    static loom::Param p = param(loom::ShardSpec::split(1, 0, 2));
    std::vector<float> x(24, 1.5f);
    loom::write_shard_file(d, 0, {{p.name, &p, 0, 24, x.data()}});
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
  for (loom::ShardSpec s : {loom::ShardSpec::split(1, 0, 2), loom::ShardSpec::whole()}) {
    try {
      const loom::Param p = param(s);
      std::vector<float> out(static_cast<size_t>(p.numel));
      loom::CheckpointReader(dir).read(p.name, p, 0, p.numel, out.data());
    } catch (const loom::Error&) {
    }
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
