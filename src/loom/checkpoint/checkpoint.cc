#include "loom/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <regex>
#include <type_traits>

#include "loom/core/error.h"
#include "loom/io/fs.h"
#include "loom/io/safetensors.h"
#include "loom/io/sha256.h"

namespace loom {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void fsync_path(const fs::path& p) {
  loom::fsync_path(p.string());
}

// Puts the finished folder `tmp` at `final_dir`. When a checkpoint of the
// same step is there (and `latest` may name it), the two are exchanged in
// one atomic rename, so the name always holds a complete checkpoint; the
// old one is removed after.
void install(const fs::path& tmp, const fs::path& final_dir) {
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
      LOOM_FAIL(kIo, "{}: cannot replace with {}: {}", final_dir.string(), tmp.string(),
                std::strerror(errno));
    fsync_path(final_dir.parent_path());
    fs::remove_all(tmp);  // now the old checkpoint
    return;
  }
  fs::rename(tmp, final_dir);
  fsync_path(final_dir.parent_path());
}

// Removes the oldest checkpoints (by step) under `root` so `keep_last` stay,
// counting the one just written, which is never removed (a run that saves
// step 4 beside an older run's step 10 keeps step 4).
void prune(const fs::path& root, const fs::path& written, int64_t keep_last) {
  std::vector<std::pair<int64_t, fs::path>> others;
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string n = entry.path().filename().string();
    if (!entry.is_directory() || !n.starts_with("step-") || entry.path() == written) continue;
    int64_t step = 0;
    const auto [end, err] = std::from_chars(n.data() + 5, n.data() + n.size(), step);
    if (err != std::errc() || end != n.data() + n.size()) continue;  // not loom's
    others.emplace_back(step, entry.path());
  }
  std::sort(others.begin(), others.end());
  const size_t keep = static_cast<size_t>(keep_last - 1);
  for (size_t i = 0; i + keep < others.size(); ++i) {
    // Renamed out of the step-* names first: a process killed while the
    // files go never leaves a half-deleted folder that looks like a checkpoint.
    const fs::path& old = others[i].second;
    const fs::path trash = old.parent_path() / ("." + old.filename().string() + ".old");
    fs::remove_all(trash);
    fs::rename(old, trash);
    fs::remove_all(trash);
  }
}

// Whether v holds a T exactly: integers must be JSON integers within T's
// range (a float or a wrapped value would be converted silently, or with
// undefined behaviour: fuzzing found {"step": 8649e94}).
template <typename T>
bool holds(const json& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    if (v.is_number_unsigned()) return v.get<uint64_t>() <= uint64_t{std::numeric_limits<T>::max()};
    if (v.is_number_integer())
      return v.get<int64_t>() >= int64_t{std::numeric_limits<T>::min()} &&
             (v.get<int64_t>() < 0 ||
              uint64_t(v.get<int64_t>()) <= uint64_t{std::numeric_limits<T>::max()});
    return false;
  } else if constexpr (std::is_floating_point_v<T>) {
    return v.is_number();
  } else if constexpr (std::is_same_v<T, std::string>) {
    return v.is_string();
  } else {
    return true;  // json: anything
  }
}

// Fault injection for the crash-safety tests: LOOM_TEST_FAULT=PHASE@STEP
// kills the process (SIGKILL, as a crash would) when the save of step STEP
// reaches PHASE: `partial` (model.safetensors half written), `rename` (every
// file durable in the temporary folder, before it is put in place) or
// `pointer` (the folder in place, before `latest` moves). Tests only.
void fault_point(const char* phase, int64_t step) {
  static const std::string spec = [] {
    const char* s = std::getenv("LOOM_TEST_FAULT");
    return std::string(s ? s : "");
  }();
  if (spec.empty()) return;
  if (spec == std::string(phase) + "@" + std::to_string(step)) std::raise(SIGKILL);
}

// A field of a checkpoint's JSON file, typed, or Error(kData) naming both.
template <typename T>
T field(const json& j, const char* key, const std::string& path) {
  const json* v = j.is_object() && j.contains(key) ? &j.at(key) : nullptr;
  if (v && holds<T>(*v)) return v->get<T>();
  LOOM_FAIL(
      kData, "{}: field '{}' is {}", path, key,
      v ? "of the wrong type (" + v->dump(-1, ' ', false, json::error_handler_t::replace) + ")"
        : std::string("missing"));
}

// The Hugging Face shape of a parameter: wte without its padding rows.
std::vector<int64_t> hf_shape(const GptStage<float>& model, const Param& p) {
  std::vector<int64_t> s;
  for (int i = 0; i < p.shape.rank(); ++i) s.push_back(p.shape[i]);
  if (p.name == "transformer.wte.weight") s[0] = model.config().vocab_size;
  return s;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

std::string shape_str(const std::vector<int64_t>& s) {
  return json(s).dump();
}

// Copies entry `e` (any float dtype) into dst (count elements).
void copy_entry(const SafetensorsEntry& e, float* dst, int64_t count) {
  convert(e.data, e.dtype, dst, DType::kF32, static_cast<size_t>(count));
}

}  // namespace

namespace {

// A checkpoint is written from a whole model (a pipelined run stages one
// on its writer first); any stage loads the parameters it holds.
void check_whole(const GptStage<float>& model, const char* what) {
  LOOM_CHECK_KIND(kUnsupported, model.has_embedding() && model.has_head(),
                  "{}: the stage holds blocks [{}, {}) of {}; this build reads and writes whole "
                  "models only",
                  what, model.first(), model.last(), model.config().n_layer);
}

// A parameter's whole tensor: its own storage when it is whole, else
// assembled from the slices into `buf` (collective over the slicing group).
const float* whole_tensor(const Param& p, const float* local, const AssembleFn& assemble,
                          std::vector<float>& buf) {
  if (!p.shard.sharded()) return local;
  LOOM_CHECK(assemble != nullptr, "parameter '{}' is a slice ({}) and nothing assembles it", p.name,
             p.shard.describe());
  buf.assign(static_cast<size_t>(p.shape.numel()), 0.0f);
  assemble(p, local, buf.data());
  return buf.data();
}

// Fills this rank's part of p (`local`, p.numel elements) from a file's
// tensor holding the leading elements of the whole (the vocabulary rows of
// wte may be fewer, or more when another layout padded them further; the
// rest of the whole tensor is padding, zero).
void load_tensor(const SafetensorsEntry& e, const Param& p, float* local) {
  const int64_t n = std::min<int64_t>(numel(e.shape), p.shape.numel());
  if (!p.shard.sharded()) {
    std::fill(local, local + p.numel, 0.0f);
    copy_entry(e, local, n);
    return;
  }
  std::vector<float> whole(static_cast<size_t>(p.shape.numel()), 0.0f);
  copy_entry(e, whole.data(), n);
  shard_from_global(p.shape, p.shard, whole.data(), local);
}

// A moment tensor's shape in the file must match the parameter's but for
// the number of vocabulary rows.
bool moment_shape_fits(const std::vector<int64_t>& file, const Param& p) {
  if (static_cast<int>(file.size()) != p.shape.rank()) return false;
  for (int i = 1; i < p.shape.rank(); ++i)
    if (file[static_cast<size_t>(i)] != p.shape[i]) return false;
  return p.name == "transformer.wte.weight" || file[0] == p.shape[0];
}

}  // namespace

namespace {

std::string save(const std::string& root, const GptStage<float>& model, const float* exp_avg,
                 const float* exp_avg_sq, const TrainerState& state, const json& config,
                 int64_t keep_last, const AssembleFn& assemble, bool write) {
  check_whole(model, "save_checkpoint");
  const std::vector<Param>& params = model.layout().params();
  LOOM_CHECK(params.front().name == "transformer.wte.weight",
             "the first parameter is '{}', not wte", params.front().name);
  const bool moments = exp_avg != nullptr && exp_avg_sq != nullptr;
  std::vector<float> buf;
  if (!write) {
    // The other ranks of the slicing group take part in the same assemblies,
    // in the same order, contributing their slices; they receive nothing.
    auto contribute = [&](const Param& p, const float* local) {
      if (p.shard.sharded() && assemble) assemble(p, local, nullptr);
    };
    for (const Param& p : params) contribute(p, model.param(p));
    contribute(params.front(), model.param(params.front()));
    if (moments)
      for (const float* base : {exp_avg, exp_avg_sq})
        for (const Param& p : params) contribute(p, base + p.offset);
    return "";
  }
  char name[32];
  std::snprintf(name, sizeof name, "step-%08ld", static_cast<long>(state.step));
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp = fs::path(root) / (std::string(".") + name + ".tmp");
  fs::create_directories(root);
  fs::remove_all(tmp);
  fs::create_directories(tmp);

  // Whole Hugging Face tensors written one at a time (a split one assembled
  // just before it is written), wte without its padding rows, and the tied
  // LM head under its own name too, as Hugging Face's state dict has it.
  auto entry = [&](const std::string& n, const Param& p) {
    const std::vector<int64_t> shape = hf_shape(model, p);
    return SafetensorsEntry{n, DType::kF32, shape, nullptr,
                            static_cast<size_t>(numel(shape)) * sizeof(float)};
  };
  std::vector<SafetensorsEntry> declared;
  for (const Param& p : params) declared.push_back(entry(p.name, p));
  declared.push_back(entry("lm_head.weight", params.front()));
  SafetensorsWriter weights((tmp / "model.safetensors").string(), declared, {{"format", "pt"}});
  for (const Param& p : params) {
    weights.append(whole_tensor(p, model.param(p), assemble, buf),
                   declared[weights.written()].bytes);
    if (weights.written() == params.size() / 2) fault_point("partial", state.step);
  }
  weights.append(whole_tensor(params.front(), model.param(params.front()), assemble, buf),
                 declared.back().bytes);
  weights.commit();

  declared.clear();
  if (moments)
    for (const char* kind : {"exp_avg.", "exp_avg_sq."})
      for (const Param& p : params) declared.push_back(entry(kind + p.name, p));
  SafetensorsWriter optimizer((tmp / "optimizer.safetensors").string(), declared);
  if (moments)
    for (const float* base : {exp_avg, exp_avg_sq})
      for (const Param& p : params)
        optimizer.append(whole_tensor(p, base + p.offset, assemble, buf),
                         declared[optimizer.written()].bytes);
  optimizer.commit();
  json st = {{"step", state.step},
             {"lr", state.lr},
             {"loss_scale", state.loss_scale},
             {"seed", state.seed},
             {"tokenizer", state.tokenizer},
             {"data", {{"next_step", state.step}, {"sampler", "philox(seed, step, sample)"}}}};
  write_file_atomic((tmp / "trainer_state.json").string(), st.dump(2) + "\n");
  write_file_atomic((tmp / "config.resolved.json").string(), config.dump(2) + "\n");

  // The tensor files were hashed as they were written; the small JSON files
  // are read back.
  json manifest = {
      {"format", "loom checkpoint v1"}, {"step", state.step}, {"files", json::object()}};
  manifest["files"]["model.safetensors"] = {{"bytes", weights.file_bytes()},
                                            {"sha256", weights.sha256()}};
  manifest["files"]["optimizer.safetensors"] = {{"bytes", optimizer.file_bytes()},
                                                {"sha256", optimizer.sha256()}};
  for (const char* f : {"trainer_state.json", "config.resolved.json"}) {
    std::string bytes = read_file((tmp / f).string());
    manifest["files"][f] = {{"bytes", bytes.size()}, {"sha256", sha256_hex(bytes)}};
  }
  write_file_atomic((tmp / "manifest.json").string(), manifest.dump(2) + "\n");
  fsync_path(tmp);
  fault_point("rename", state.step);
  install(tmp, final_dir);
  fault_point("pointer", state.step);
  write_file_atomic((fs::path(root) / "latest").string(), std::string(name) + "\n");
  if (keep_last > 0) prune(root, final_dir, keep_last);
  return final_dir.string();
}

}  // namespace

std::string save_checkpoint(const std::string& root, const GptStage<float>& model,
                            const float* exp_avg, const float* exp_avg_sq,
                            const TrainerState& state, const json& config, int64_t keep_last,
                            const AssembleFn& assemble, bool write) {
  // The file system's own errors (a full disk, a read-only folder) name the
  // checkpoint folder like loom's.
  try {
    return save(root, model, exp_avg, exp_avg_sq, state, config, keep_last, assemble, write);
  } catch (const fs::filesystem_error& e) {
    LOOM_FAIL(kIo, "checkpoint save into {}: {}", root, e.what());
  }
}

std::string resolve_checkpoint(const std::string& dir_or_latest, const std::string& root) {
  if (dir_or_latest != "latest") return dir_or_latest;
  fs::path pointer = fs::path(root) / "latest";
  std::error_code ec;
  LOOM_CHECK_KIND(kIo, fs::exists(pointer, ec),
                  "--resume latest: no checkpoint in {} ({} is missing)", root, pointer.string());
  std::string name = read_file(pointer.string());
  name.erase(name.find_last_not_of(" \n") + 1);
  return (fs::path(root) / name).string();
}

void verify_checkpoint(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  LOOM_CHECK_KIND(kIo, fs::is_directory(d, ec), "{}: not a checkpoint folder", dir);
  LOOM_CHECK_KIND(kData, fs::exists(d / "manifest.json", ec),
                  "{}: no manifest.json (incomplete or not a checkpoint)", dir);
  const std::string mpath = (d / "manifest.json").string();
  const json m = read_json_file(mpath);
  const json files = field<json>(m, "files", mpath);
  LOOM_CHECK_KIND(kData, files.is_object(), "{}: field 'files' is not an object", mpath);
  // What every checkpoint holds; a manifest listing less is damaged.
  for (const char* f : {"model.safetensors", "trainer_state.json", "config.resolved.json"})
    LOOM_CHECK_KIND(kData, files.contains(f), "{}: lists no {} (damaged or not loom's)", mpath, f);
  for (const auto& [file, info] : files.items()) {
    LOOM_CHECK_KIND(kData, file.find('/') == std::string::npos && file != "..",
                    "{}: file name '{}' leaves the folder", mpath, file);
    fs::path p = d / file;
    LOOM_CHECK_KIND(kData, fs::exists(p, ec), "{}: missing (listed in manifest.json)", p.string());
    const std::string where = mpath + " files." + file;
    const size_t want = field<size_t>(info, "bytes", where);
    const std::string sha = field<std::string>(info, "sha256", where);
    std::string bytes = read_file(p.string());
    LOOM_CHECK_KIND(kData, bytes.size() == want, "{}: {} bytes, manifest says {}", p.string(),
                    bytes.size(), want);
    LOOM_CHECK_KIND(kData, sha256_hex(bytes) == sha,
                    "{}: checksum mismatch (SHA-256 differs from manifest.json)", p.string());
  }
}

json read_checkpoint_config(const std::string& dir) {
  return read_json_file((fs::path(dir) / "config.resolved.json").string());
}

TrainerState read_trainer_state(const std::string& dir) {
  const std::string path = (fs::path(dir) / "trainer_state.json").string();
  const json j = read_json_file(path);
  TrainerState s;
  s.step = field<int64_t>(j, "step", path);
  s.lr = field<double>(j, "lr", path);
  s.loss_scale = field<double>(j, "loss_scale", path);
  s.seed = field<uint64_t>(j, "seed", path);
  s.tokenizer = field<std::string>(j, "tokenizer", path);
  LOOM_CHECK_KIND(kData, s.step >= 0, "{}: field 'step' is negative ({})", path, s.step);
  return s;
}

TrainerState load_checkpoint(const std::string& dir, GptStage<float>& model, float* exp_avg,
                             float* exp_avg_sq) {
  verify_checkpoint(dir);
  const fs::path d(dir);
  SafetensorsFile weights((d / "model.safetensors").string());
  for (const Param& p : model.layout().params()) {
    const SafetensorsEntry* e = weights.find(p.name);
    LOOM_CHECK_KIND(kData, e != nullptr, "{}: no tensor '{}'", weights.path(), p.name);
    std::vector<int64_t> want = hf_shape(model, p);
    LOOM_CHECK_KIND(kData, e->shape == want, "{}: '{}' has shape {} but the config needs {}",
                    weights.path(), p.name, shape_str(e->shape), shape_str(want));
    load_tensor(*e, p, model.param(p));
  }
  if (exp_avg != nullptr && exp_avg_sq != nullptr) {
    SafetensorsFile moments((d / "optimizer.safetensors").string());
    for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
      float* base = std::string(kind) == "exp_avg" ? exp_avg : exp_avg_sq;
      for (const Param& p : model.layout().params()) {
        std::string name = std::string(kind) + "." + p.name;
        const SafetensorsEntry* e = moments.find(name);
        LOOM_CHECK_KIND(kData, e != nullptr, "{}: no tensor '{}'", moments.path(), name);
        LOOM_CHECK_KIND(kData, moment_shape_fits(e->shape, p), "{}: '{}' has shape {}, expected {}",
                        moments.path(), name, shape_str(e->shape), p.shape.str());
        load_tensor(*e, p, base + p.offset);
      }
    }
  }
  return read_trainer_state(dir);
}

void load_hf_weights(const std::string& path, GptStage<float>& model) {
  SafetensorsFile f(path);
  const GptConfig& c = model.config();
  // The model's shape as the file describes it, checked key by key.
  const SafetensorsEntry* wte = f.find("transformer.wte.weight");
  const SafetensorsEntry* wpe = f.find("transformer.wpe.weight");
  LOOM_CHECK_KIND(kData, wte && wpe && wte->shape.size() == 2 && wpe->shape.size() == 2,
                  "{}: not a GPT-2 state dict (needs transformer.wte.weight and "
                  "transformer.wpe.weight)",
                  path);
  int n_layer = 0;
  std::regex layer_re(R"(^transformer\.h\.(\d+)\.)");
  for (const auto& e : f.entries()) {
    std::smatch m;
    if (!std::regex_search(e.name, m, layer_re)) continue;
    const std::string digits = m[1];
    int layer = 0;
    const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), layer);
    LOOM_CHECK_KIND(kData, err == std::errc() && layer < 1 << 20,
                    "{}: tensor '{}': layer {} is out of range", path, e.name, digits);
    n_layer = std::max(n_layer, layer + 1);
  }
  auto check = [&](const char* key, int64_t file_value, int64_t config_value) {
    LOOM_CHECK_KIND(kConfig, file_value == config_value,
                    "--init-from {}: the file has {} {} but "
                    "the config's {} is {}",
                    path, key, file_value, key, config_value);
  };
  check("model.n_layer", n_layer, c.n_layer);
  check("model.n_embd", wte->shape[1], c.n_embd);
  check("model.vocab_size", wte->shape[0], c.vocab_size);
  check("model.seq_len", wpe->shape[0], c.seq_len);
  for (const Param& p : model.layout().params()) {
    const SafetensorsEntry* e = f.find(p.name);
    LOOM_CHECK_KIND(kData, e != nullptr, "{}: no tensor '{}'", path, p.name);
    std::vector<int64_t> want = hf_shape(model, p);
    LOOM_CHECK_KIND(kData, e->shape == want, "{}: '{}' has shape {} but the config needs {}", path,
                    p.name, shape_str(e->shape), shape_str(want));
    load_tensor(*e, p, model.param(p));
  }
}

}  // namespace loom
