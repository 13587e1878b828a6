#include "loom/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <regex>
#include <type_traits>

#include "loom/checkpoint/sharded.h"
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
  const fs::path tmp = begin_checkpoint(root, state.step);

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
    if (weights.written() == params.size() / 2) checkpoint_fault_point("partial", state.step);
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
  // The tensor files were hashed as they were written.
  json manifest = {{"format", "loom checkpoint v1"}, {"files", json::object()}};
  manifest["files"]["model.safetensors"] = {{"bytes", weights.file_bytes()},
                                            {"sha256", weights.sha256()}};
  manifest["files"]["optimizer.safetensors"] = {{"bytes", optimizer.file_bytes()},
                                                {"sha256", optimizer.sha256()}};
  return finish_checkpoint(root, state, config, std::move(manifest), keep_last);
}

}  // namespace

std::string checkpoint_staging_folder(const std::string& root, int64_t step) {
  char name[40];
  std::snprintf(name, sizeof name, ".step-%08ld.tmp", static_cast<long>(step));
  return (fs::path(root) / name).string();
}

std::string begin_checkpoint(const std::string& root, int64_t step) {
  try {
    const fs::path tmp = checkpoint_staging_folder(root, step);
    fs::create_directories(root);
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    return tmp.string();
  } catch (const fs::filesystem_error& e) {
    LOOM_FAIL(kIo, "checkpoint save into {}: {}", root, e.what());
  }
}

namespace {

std::string finish(const std::string& root, const TrainerState& state, const json& config,
                   json manifest, int64_t keep_last) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08ld", static_cast<long>(state.step));
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp = checkpoint_staging_folder(root, state.step);
  json st = {{"step", state.step},
             {"lr", state.lr},
             {"loss_scale", state.loss_scale},
             {"seed", state.seed},
             {"tokenizer", state.tokenizer},
             {"skipped_steps", state.skipped_steps},
             {"data", {{"next_step", state.step}, {"sampler", "philox(seed, step, sample)"}}}};
  if (state.scaler_iteration >= 0)
    st["loss_scaler"] = {{"iteration", state.scaler_iteration},
                         {"last_overflow", state.scaler_last_overflow},
                         {"hysteresis_left", state.scaler_hysteresis}};
  write_file_atomic((tmp / "trainer_state.json").string(), st.dump(2) + "\n");
  write_file_atomic((tmp / "config.resolved.json").string(), config.dump(2) + "\n");
  // The small JSON files are read back; the tensor files were hashed by
  // their writers.
  manifest["step"] = state.step;
  for (const char* f : {"trainer_state.json", "config.resolved.json"}) {
    std::string bytes = read_file((tmp / f).string());
    manifest["files"][f] = {{"bytes", bytes.size()}, {"sha256", sha256_hex(bytes)}};
  }
  write_file_atomic((tmp / "manifest.json").string(), manifest.dump(2) + "\n");
  fsync_path(tmp);
  checkpoint_fault_point("rename", state.step);
  install(tmp, final_dir);
  checkpoint_fault_point("pointer", state.step);
  write_file_atomic((fs::path(root) / "latest").string(), std::string(name) + "\n");
  if (keep_last > 0) prune(root, final_dir, keep_last);
  return final_dir.string();
}

}  // namespace

std::string finish_checkpoint(const std::string& root, const TrainerState& state,
                              const json& config, json manifest, int64_t keep_last) {
  try {
    return finish(root, state, config, std::move(manifest), keep_last);
  } catch (const fs::filesystem_error& e) {
    LOOM_FAIL(kIo, "checkpoint save into {}: {}", root, e.what());
  }
}

void checkpoint_fault_point(const char* phase, int64_t step, int rank) {
  static const std::string spec = [] {
    const char* s = std::getenv("LOOM_TEST_FAULT");
    return std::string(s ? s : "");
  }();
  if (spec.empty()) return;
  const std::string at = std::string(phase) + "@" + std::to_string(step);
  if (spec == at + ":" + std::to_string(rank) || (rank == 0 && spec == at)) std::raise(SIGKILL);
}

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

void verify_checkpoint(const std::string& dir, int part, int parts) {
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
  const bool sharded = m.is_object() && m.value("format", json()) == "loom checkpoint v2";
  for (const char* f : {"trainer_state.json", "config.resolved.json"})
    LOOM_CHECK_KIND(kData, files.contains(f), "{}: lists no {} (damaged or not loom's)", mpath, f);
  if (sharded) {
    // Every tensor has pieces in listed files (CheckpointReader checks each
    // piece against its tensor's shape).
    const json tensors = field<json>(m, "tensors", mpath);
    LOOM_CHECK_KIND(kData, tensors.is_object() && !tensors.empty(),
                    "{}: field 'tensors' lists no tensor", mpath);
    CheckpointReader reader(dir);
  } else {
    LOOM_CHECK_KIND(kData, files.contains("model.safetensors"),
                    "{}: lists no model.safetensors (damaged or not loom's)", mpath);
  }
  int i = 0;
  for (const auto& [file, info] : files.items()) {
    LOOM_CHECK_KIND(kData, file.find('/') == std::string::npos && file != "..",
                    "{}: file name '{}' leaves the folder", mpath, file);
    fs::path p = d / file;
    LOOM_CHECK_KIND(kData, fs::exists(p, ec), "{}: missing (listed in manifest.json)", p.string());
    const std::string where = mpath + " files." + file;
    const size_t want = field<size_t>(info, "bytes", where);
    const std::string sha = field<std::string>(info, "sha256", where);
    const size_t size = fs::file_size(p, ec);
    LOOM_CHECK_KIND(kData, !ec && size == want, "{}: {} bytes, manifest says {}", p.string(),
                    ec ? 0 : size, want);
    // Rank r hashes rank r's file (a same-layout resume reads it anyway);
    // the small files are shared out in turn.
    int owner = i++ % parts;
    int r = 0;
    if (std::sscanf(file.c_str(), "rank-%d.safetensors", &r) == 1) owner = r % parts;
    if (owner != part) continue;
    size_t read = 0;
    LOOM_CHECK_KIND(kData, sha256_file(p.string(), &read) == sha && read == want,
                    "{}: checksum mismatch (SHA-256 differs from manifest.json)", p.string());
  }
}

json read_checkpoint_config(const std::string& dir) {
  return read_json_file((fs::path(dir) / "config.resolved.json").string());
}

GptConfig read_checkpoint_model(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.resolved.json").string();
  const json j = read_json_file(path);
  const json m = field<json>(j, "model", path + " model");
  const std::string where = path + " model";
  GptConfig c;
  c.n_layer = field<int>(m, "n_layer", where);
  c.n_embd = field<int>(m, "n_embd", where);
  c.n_head = field<int>(m, "n_head", where);
  c.vocab_size = field<int>(m, "vocab_size", where);
  c.seq_len = field<int>(m, "seq_len", where);
  LOOM_CHECK_KIND(kData,
                  c.n_layer > 0 && c.n_embd > 0 && c.n_head > 0 && c.vocab_size > 0 &&
                      c.seq_len > 0 && c.n_embd % c.n_head == 0,
                  "{}: not a model shape (n_layer {}, n_embd {}, n_head {}, vocab_size {}, "
                  "seq_len {})",
                  where, c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.seq_len);
  if (m.contains("moe")) {
    const json moe = field<json>(m, "moe", where);
    const std::string mw = where + ".moe";
    c.moe_experts = field<int>(moe, "num_experts", mw);
    c.moe_top_k = field<int>(moe, "top_k", mw);
    c.moe_every = field<int>(moe, "every_n_layers", mw);
    c.moe_capacity_factor = field<double>(moe, "capacity_factor", mw);
    // Fixed routers (hash, tag) have no balancing losses; checkpoints
    // saved before routers and bias balancing existed lack those keys.
    c.moe_aux_loss_coef =
        moe.contains("aux_loss_coef") ? field<double>(moe, "aux_loss_coef", mw) : 0;
    c.moe_z_loss_coef = moe.contains("z_loss_coef") ? field<double>(moe, "z_loss_coef", mw) : 0;
    if (moe.contains("balancing"))
      c.moe_bias_balancing = field<std::string>(moe, "balancing", mw) == "bias";
    const std::string router =
        moe.contains("router") ? field<std::string>(moe, "router", mw) : "learned";
    LOOM_CHECK_KIND(kData, router == "learned" || router == "hash" || router == "tag",
                    "{}.router: unknown router \"{}\"", mw, router);
    c.moe_router = router == "hash" ? 1 : router == "tag" ? 2 : 0;
    if (c.moe_router == 2)
      for (int64_t id : field<std::vector<int64_t>>(moe, "tag_tokens", mw)) {
        LOOM_CHECK_KIND(kData, id >= 0 && id < c.vocab_size,
                        "{}.tag_tokens: {} is outside the vocabulary of {}", mw, id, c.vocab_size);
        c.moe_tag_tokens.push_back(static_cast<int32_t>(id));
      }
    LOOM_CHECK_KIND(
        kData,
        c.moe_experts >= 1 && c.moe_top_k >= 1 && c.moe_top_k <= c.moe_experts && c.moe_every >= 1,
        "{}: not a mixture of experts (num_experts {}, top_k {}, every_n_layers {})", mw,
        c.moe_experts, c.moe_top_k, c.moe_every);
  }
  return c;
}

namespace {

int64_t consolidate(const std::string& dir, const std::string& out) {
  std::error_code ec;
  LOOM_CHECK_KIND(kIo, !fs::exists(out, ec), "{}: already exists (consolidate writes a new folder)",
                  out);
  // The model's layout alone: names, shapes and the whole-model slicing.
  const GptStage<float> model(read_checkpoint_model(dir), StageSpec{},
                              StoreOptions{1, false, false});
  const std::vector<Param>& params = model.layout().params();
  const CheckpointReader reader(dir);
  const fs::path dst(out);
  const fs::path tmp = dst.parent_path() / ("." + dst.filename().string() + ".tmp");
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  int64_t written = 0;
  Buffer buf;
  // One file of whole tensors, one at a time: `names` in the file, read
  // from the checkpoint's `sources`.
  auto write = [&](const std::string& file, const std::vector<std::string>& names,
                   const std::vector<const Param*>& sources, const std::vector<std::string>& from,
                   const std::map<std::string, std::string>& meta) {
    std::vector<SafetensorsEntry> declared;
    for (size_t i = 0; i < names.size(); ++i) {
      const std::vector<int64_t> shape = hf_shape(model, *sources[i]);
      declared.push_back(SafetensorsEntry{names[i], DType::kF32, shape, nullptr,
                                          static_cast<size_t>(numel(shape)) * sizeof(float)});
    }
    SafetensorsWriter w((tmp / file).string(), declared, meta);
    for (size_t i = 0; i < names.size(); ++i) {
      const Param& p = *sources[i];
      if (buf.bytes() < static_cast<size_t>(p.numel) * sizeof(float))
        buf = Buffer(static_cast<size_t>(p.numel) * sizeof(float), MemCategory::kWorkspace);
      reader.read(from[i], p, 0, p.numel, buf.as<float>());
      w.append(buf.data(), declared[i].bytes);  // wte's leading (unpadded) rows
      ++written;
    }
    w.commit();
    return json{{"bytes", w.file_bytes()}, {"sha256", w.sha256()}};
  };
  json manifest = {{"format", "loom checkpoint v1"}, {"files", json::object()}};
  std::vector<std::string> names, from;
  std::vector<const Param*> sources;
  for (const Param& p : params)
    names.push_back(p.name), from.push_back(p.name), sources.push_back(&p);
  // The tied LM head under its own name too, as Hugging Face's state dict has it.
  names.push_back("lm_head.weight"), from.push_back(params.front().name);
  sources.push_back(&params.front());
  manifest["files"]["model.safetensors"] =
      write("model.safetensors", names, sources, from, {{"format", "pt"}});
  names.clear(), from.clear(), sources.clear();
  if (reader.has("exp_avg." + params.front().name))
    for (const char* kind : {"exp_avg.", "exp_avg_sq."})
      for (const Param& p : params)
        names.push_back(kind + p.name), from.push_back(kind + p.name), sources.push_back(&p);
  manifest["files"]["optimizer.safetensors"] =
      write("optimizer.safetensors", names, sources, from, {});
  for (const char* f : {"trainer_state.json", "config.resolved.json"}) {
    const std::string bytes = read_file((fs::path(dir) / f).string());
    write_file_atomic((tmp / f).string(), bytes);
    manifest["files"][f] = {{"bytes", bytes.size()}, {"sha256", sha256_hex(bytes)}};
  }
  manifest["step"] = read_trainer_state(dir).step;
  write_file_atomic((tmp / "manifest.json").string(), manifest.dump(2) + "\n");
  fsync_path(tmp);
  fs::rename(tmp, dst);
  fsync_path(dst.parent_path().empty() ? fs::path(".") : dst.parent_path());
  return written;
}

}  // namespace

int64_t consolidate_checkpoint(const std::string& dir, const std::string& out) {
  verify_checkpoint(dir);
  try {
    return consolidate(dir, out);
  } catch (const fs::filesystem_error& e) {
    LOOM_FAIL(kIo, "checkpoint consolidate into {}: {}", out, e.what());
  }
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
  // Absent from checkpoints written before steps could be skipped.
  if (j.contains("skipped_steps")) s.skipped_steps = field<int64_t>(j, "skipped_steps", path);
  LOOM_CHECK_KIND(kData, s.skipped_steps >= 0 && s.skipped_steps <= s.step,
                  "{}: field 'skipped_steps' ({}) is not in [0, step]", path, s.skipped_steps);
  LOOM_CHECK_KIND(kData, s.step >= 0, "{}: field 'step' is negative ({})", path, s.step);
  if (j.contains("loss_scaler")) {
    const json& ls = j["loss_scaler"];
    LOOM_CHECK_KIND(kData, ls.is_object(), "{}: field 'loss_scaler' is not an object", path);
    s.scaler_iteration = field<int64_t>(ls, "iteration", path);
    s.scaler_last_overflow = field<int64_t>(ls, "last_overflow", path);
    s.scaler_hysteresis = field<int>(ls, "hysteresis_left", path);
    LOOM_CHECK_KIND(kData,
                    s.scaler_iteration >= 0 && s.scaler_last_overflow >= -1 &&
                        s.scaler_last_overflow < s.scaler_iteration + 1 && s.scaler_hysteresis >= 0,
                    "{}: field 'loss_scaler' is inconsistent (iteration {}, last_overflow {}, "
                    "hysteresis_left {})",
                    path, s.scaler_iteration, s.scaler_last_overflow, s.scaler_hysteresis);
    LOOM_CHECK_KIND(kData, s.loss_scale > 0 && std::isfinite(s.loss_scale),
                    "{}: field 'loss_scale' ({}) must be a positive number", path, s.loss_scale);
  }
  return s;
}

TrainerState load_checkpoint(const std::string& dir, GptStage<float>& model, float* exp_avg,
                             float* exp_avg_sq) {
  verify_checkpoint(dir);
  const CheckpointReader reader(dir);
  for (const Param& p : model.layout().params()) {
    reader.read(p.name, p, 0, p.numel, model.param(p));
    if (exp_avg != nullptr && exp_avg_sq != nullptr) {
      reader.read("exp_avg." + p.name, p, 0, p.numel, exp_avg + p.offset);
      reader.read("exp_avg_sq." + p.name, p, 0, p.numel, exp_avg_sq + p.offset);
    }
  }
  return read_trainer_state(dir);
}

void check_hf_weights(const std::string& path, const GptConfig& c) {
  SafetensorsFile f(path);
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
}

void load_hf_weights(const std::string& path, GptStage<float>& model) {
  check_hf_weights(path, model.config());
  const CheckpointReader reader = CheckpointReader::of_file(path);
  for (const Param& p : model.layout().params()) reader.read(p.name, p, 0, p.numel, model.param(p));
}

}  // namespace loom
