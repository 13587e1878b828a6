#include "loom/checkpoint/sharded.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <tuple>

#include "loom/core/error.h"
#include "loom/core/fault.h"
#include "loom/core/memory.h"
#include "loom/core/range.h"
#include "loom/io/fs.h"

namespace loom {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kShardFormat = "loom shard v1";

const char* kind_name(ShardSpec::Kind k) {
  switch (k) {
    case ShardSpec::kWhole:
      return "whole";
    case ShardSpec::kDim:
      return "dim";
    case ShardSpec::kHeads:
      return "heads";
    case ShardSpec::kVocab:
      return "vocab";
  }
  return "?";
}

bool unsharded(const ShardSpec& s) {
  return s.kind == ShardSpec::kWhole || s.count == 1;
}

bool same_slicing(const ShardSpec& a, const ShardSpec& b) {
  if (unsharded(a) || unsharded(b)) return unsharded(a) && unsharded(b);
  return a.kind == b.kind && a.dim == b.dim && a.index == b.index && a.count == b.count &&
         a.blocks == b.blocks;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape to_shape(const std::vector<int64_t>& s) {
  return Shape(s);
}

// A whole number in [lo, hi] from a JSON value, or Error(kData) naming `what`.
int64_t whole_number(const json& v, int64_t lo, int64_t hi, const std::string& what) {
  LOOM_CHECK_KIND(kData, v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi,
                  "{}: expected a whole number in [{}, {}], got {}", what, lo, hi,
                  v.dump(-1, ' ', false, json::error_handler_t::replace));
  return v.get<int64_t>();
}

std::vector<int64_t> parse_shape(const json& v, const std::string& what) {
  LOOM_CHECK_KIND(kData, v.is_array() && v.size() <= 4, "{}: not a shape", what);
  std::vector<int64_t> s;
  int64_t n = 1;
  for (const json& d : v) {
    s.push_back(whole_number(d, 0, int64_t{1} << 40, what));
    LOOM_CHECK_KIND(kData, s.back() == 0 || n <= (int64_t{1} << 40) / s.back(),
                    "{}: shape {} is too large", what, v.dump());
    n *= s.back();
  }
  return s;
}

ShardSpec parse_spec(const json& v, const std::vector<int64_t>& shape, const std::string& what) {
  LOOM_CHECK_KIND(kData, v.is_object() && v.contains("kind") && v["kind"].is_string(),
                  "{}: 'shard' is not a slicing", what);
  ShardSpec s;
  const std::string kind = v["kind"].get<std::string>();
  if (kind == "whole") return s;
  if (kind == "dim")
    s.kind = ShardSpec::kDim;
  else if (kind == "heads")
    s.kind = ShardSpec::kHeads;
  else if (kind == "vocab")
    s.kind = ShardSpec::kVocab;
  else
    LOOM_FAIL(kData, "{}: unknown slicing '{}'", what, kind);
  auto get = [&](const char* key) {
    LOOM_CHECK_KIND(kData, v.contains(key), "{}: slicing has no '{}'", what, key);
    return v[key];
  };
  s.count = static_cast<int>(whole_number(get("count"), 1, 1 << 20, what + " shard.count"));
  s.index = static_cast<int>(whole_number(get("index"), 0, s.count - 1, what + " shard.index"));
  s.dim =
      static_cast<int>(whole_number(get("dim"), 0, int64_t(shape.size()) - 1, what + " shard.dim"));
  s.blocks = static_cast<int>(whole_number(get("blocks"), 1, 1 << 20, what + " shard.blocks"));
  try {
    shard_shape(to_shape(shape), s);
  } catch (const Error& e) {
    LOOM_FAIL(kData, "{}: slicing does not fit shape {}: {}", what, json(shape).dump(), e.what());
  }
  return s;
}

}  // namespace

std::string shard_file_name(int rank) {
  char name[40];
  std::snprintf(name, sizeof name, "rank-%05d.safetensors", rank);
  return name;
}

json shard_spec_json(const ShardSpec& s) {
  if (unsharded(s)) return {{"kind", "whole"}};
  return {{"kind", kind_name(s.kind)},
          {"dim", s.dim},
          {"index", s.index},
          {"count", s.count},
          {"blocks", s.blocks}};
}

ShardFileInfo write_shard_file(const std::string& folder, int rank,
                               const std::vector<PieceOut>& pieces,
                               const std::function<void()>& on_half,
                               const std::atomic<bool>* stop) {
  std::vector<SafetensorsEntry> entries;
  json index = json::object();
  for (const PieceOut& pc : pieces) {
    const int64_t n = pc.end - pc.begin;
    entries.push_back(
        SafetensorsEntry{pc.tensor, DType::kF32, {n}, nullptr, static_cast<size_t>(n) * 4});
    std::vector<int64_t> shape;
    for (int i = 0; i < pc.param->shape.rank(); ++i) shape.push_back(pc.param->shape[i]);
    index[pc.tensor] = {{"shape", shape},
                        {"shard", shard_spec_json(pc.param->shard)},
                        {"range", {pc.begin, pc.end}}};
  }
  SafetensorsWriter w((fs::path(folder) / shard_file_name(rank)).string(), entries,
                      {{"format", kShardFormat}, {"pieces", index.dump()}});
  for (size_t i = 0; i < pieces.size(); ++i) {
    LOOM_CHECK_KIND(kIo, !stop || !*stop, "{}: save stopped (the run is ending on an error)",
                    folder);
    w.append(pieces[i].data, entries[i].bytes);
    if (i + 1 == (pieces.size() + 1) / 2) {
      fault_point("checkpoint");
      if (on_half) on_half();
    }
  }
  w.commit();
  return {w.file_bytes(), w.sha256()};
}

json index_shard_files(const std::string& folder, int ranks) {
  json tensors = json::object();
  for (int r = 0; r < ranks; ++r) {
    const std::string name = shard_file_name(r);
    SafetensorsFile f((fs::path(folder) / name).string());
    const auto& meta = f.metadata();
    LOOM_CHECK_KIND(kData, meta.count("format") && meta.at("format") == kShardFormat,
                    "{}: not a loom shard file (metadata 'format' is not '{}')", f.path(),
                    kShardFormat);
    const json pieces = json::parse(meta.count("pieces") ? meta.at("pieces") : "", nullptr, false);
    LOOM_CHECK_KIND(kData, pieces.is_object(), "{}: metadata 'pieces' is not a JSON object",
                    f.path());
    for (const auto& [tensor, info] : pieces.items()) {
      const std::string what = f.path() + " piece " + tensor;
      LOOM_CHECK_KIND(kData, f.find(tensor) != nullptr, "{}: no tensor data", what);
      json& t = tensors[tensor];
      if (t.is_null()) t = {{"shape", info.at("shape")}, {"pieces", json::array()}};
      LOOM_CHECK_KIND(kData, t["shape"] == info.at("shape"),
                      "{}: shape {} differs from another rank's {}", what, info.at("shape").dump(),
                      t["shape"].dump());
      t["pieces"].push_back(
          {{"file", name}, {"shard", info.at("shard")}, {"range", info.at("range")}});
    }
  }
  return tensors;
}

CheckpointReader::CheckpointReader(const std::string& dir) : dir_(dir) {
  const std::string mpath = (fs::path(dir) / "manifest.json").string();
  where_ = mpath;
  const json m = read_json_file(mpath);
  LOOM_CHECK_KIND(kData, m.is_object() && m.contains("files") && m["files"].is_object(),
                  "{}: field 'files' is missing or not an object", mpath);
  const json& files = m["files"];
  LOOM_CHECK_KIND(kData, !m.contains("format") || m["format"].is_string(),
                  "{}: field 'format' is not a string", mpath);
  const std::string format = m.value("format", std::string());
  if (format != "loom checkpoint v2") {
    // A whole checkpoint: every tensor whole in two files.
    add_whole_file((fs::path(dir) / "model.safetensors").string(), "model.safetensors");
    if (files.contains("optimizer.safetensors"))
      add_whole_file((fs::path(dir) / "optimizer.safetensors").string(), "optimizer.safetensors");
    return;
  }
  LOOM_CHECK_KIND(kData, m.contains("tensors") && m["tensors"].is_object(),
                  "{}: field 'tensors' is missing or not an object", mpath);
  for (const auto& [name, info] : m["tensors"].items()) {
    const std::string what = mpath + " tensors." + name;
    LOOM_CHECK_KIND(kData,
                    info.is_object() && info.contains("shape") && info.contains("pieces") &&
                        info["pieces"].is_array(),
                    "{}: needs 'shape' and a list of 'pieces'", what);
    Tensor t;
    t.shape = parse_shape(info["shape"], what + ".shape");
    for (const json& pc : info["pieces"]) {
      LOOM_CHECK_KIND(kData,
                      pc.is_object() && pc.contains("file") && pc["file"].is_string() &&
                          pc.contains("shard") && pc.contains("range") && pc["range"].is_array() &&
                          pc["range"].size() == 2,
                      "{}: a piece needs 'file', 'shard' and 'range' [begin, end]", what);
      Piece p;
      p.file = pc["file"].get<std::string>();
      LOOM_CHECK_KIND(kData, files.contains(p.file),
                      "{}: piece in '{}', which 'files' does not list", what, p.file);
      p.shard = parse_spec(pc["shard"], t.shape, what);
      const int64_t n = shard_shape(to_shape(t.shape), p.shard).numel();
      p.begin = whole_number(pc["range"][0], 0, n, what + " range");
      p.end = whole_number(pc["range"][1], p.begin, n, what + " range");
      t.pieces.push_back(std::move(p));
    }
    // Pieces of one slice never overlap (each element has one source).
    std::vector<const Piece*> order;
    for (const Piece& p : t.pieces) order.push_back(&p);
    auto key = [](const Piece* p) {
      const ShardSpec& s = p->shard;
      return unsharded(s)
                 ? std::make_tuple(-1, 0, 0, 0, 0, p->begin)
                 : std::make_tuple(int(s.kind), s.dim, s.count, s.blocks, s.index, p->begin);
    };
    std::sort(order.begin(), order.end(),
              [&](const Piece* a, const Piece* b) { return key(a) < key(b); });
    for (size_t i = 1; i < order.size(); ++i)
      LOOM_CHECK_KIND(kData,
                      !same_slicing(order[i - 1]->shard, order[i]->shard) ||
                          order[i - 1]->end <= order[i]->begin,
                      "{}: pieces [{}, {}) and [{}, {}) overlap", what, order[i - 1]->begin,
                      order[i - 1]->end, order[i]->begin, order[i]->end);
    // ... and together they hold every element (pieces of one slicing for
    // each index, disjoint).
    int64_t held = 0;
    for (const Piece& p : t.pieces) held += p.end - p.begin;
    LOOM_CHECK_KIND(kData, held == numel(t.shape),
                    "{}: the pieces hold {} of its {} elements (a rank's file missing from the "
                    "manifest?)",
                    what, held, numel(t.shape));
    tensors_[name] = std::move(t);
  }
}

CheckpointReader CheckpointReader::of_file(const std::string& path) {
  CheckpointReader r;
  r.dir_ = fs::path(path).parent_path().string();
  r.where_ = path;
  r.add_whole_file(path, fs::path(path).filename().string());
  return r;
}

CheckpointReader::~CheckpointReader() = default;
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;

void CheckpointReader::add_whole_file(const std::string& path, const std::string& file) {
  auto f = std::make_unique<SafetensorsFile>(path);
  for (const SafetensorsEntry& e : f->entries())
    tensors_[e.name] = Tensor{e.shape, {Piece{file, ShardSpec::whole(), 0, numel(e.shape)}}};
  files_[file] = std::move(f);
}

bool CheckpointReader::has(const std::string& name) const {
  return tensors_.count(name) != 0;
}

const CheckpointReader::Tensor& CheckpointReader::tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  LOOM_CHECK_KIND(kData, it != tensors_.end(), "{}: no tensor '{}'", where_, name);
  return it->second;
}

const std::vector<int64_t>& CheckpointReader::shape(const std::string& name) const {
  return tensor(name).shape;
}

const SafetensorsFile& CheckpointReader::file(const std::string& name) const {
  auto& f = files_[name];
  if (!f) f = std::make_unique<SafetensorsFile>((fs::path(dir_) / name).string());
  return *f;
}

const SafetensorsEntry& CheckpointReader::entry(const std::string& name, const Piece& pc) const {
  const SafetensorsFile& f = file(pc.file);
  const SafetensorsEntry* e = f.find(name);
  LOOM_CHECK_KIND(kData, e != nullptr, "{}: no tensor '{}' (the manifest places a piece there)",
                  f.path(), name);
  LOOM_CHECK_KIND(kData, numel(e->shape) == pc.end - pc.begin,
                  "{}: '{}' holds {} elements, the manifest's piece [{}, {}) {}", f.path(), name,
                  numel(e->shape), pc.begin, pc.end, pc.end - pc.begin);
  return *e;
}

DType CheckpointReader::stored_dtype(const std::string& name) const {
  const Tensor& t = tensor(name);
  LOOM_CHECK_KIND(kData, !t.pieces.empty(), "{}: tensor '{}' has no pieces", where_, name);
  return entry(name, t.pieces.front()).dtype;
}

void CheckpointReader::copy_piece(const std::string& name, const Piece& pc, int64_t begin,
                                  int64_t end, float* dst) const {
  const SafetensorsEntry& e = entry(name, pc);
  const char* src = static_cast<const char*>(e.data) +
                    static_cast<size_t>(begin - pc.begin) * dtype_size(e.dtype);
  const size_t n = static_cast<size_t>(end - begin);
  convert(src, e.dtype, dst, DType::kF32, n);
  file(pc.file).drop(src, n * dtype_size(e.dtype));
}

void CheckpointReader::read(const std::string& name, const Param& p, int64_t begin, int64_t end,
                            float* dst) const {
  const Tensor& t = tensor(name);
  const std::vector<int64_t> want = p.shape.dims();
  bool fits = t.shape.size() == want.size() && !want.empty();
  for (size_t i = 1; fits && i < want.size(); ++i) fits = t.shape[i] == want[i];
  // wte's rows may be padded differently, but every real (vocabulary) row
  // must be there.
  if (fits && p.name != "transformer.wte.weight") fits = t.shape[0] == want[0];
  if (fits && p.name == "transformer.wte.weight") fits = t.shape[0] >= p.init.valid_rows;
  if (!fits) {
    // wte's rows may differ (vocabulary padding): show the dimensions that do not.
    std::vector<int64_t> needs = want;
    if (p.name == "transformer.wte.weight" && !t.shape.empty() && !needs.empty())
      needs[0] = t.shape[0] >= p.init.valid_rows ? t.shape[0] : p.init.valid_rows;
    LOOM_FAIL(kData, "{}: '{}' has shape {} but the config needs {}", where_, name,
              json(t.shape).dump(), json(needs).dump());
  }
  LOOM_CHECK(begin >= 0 && begin <= end && end <= p.numel, "read of [{}, {}) of '{}' ({} elements)",
             begin, end, name, p.numel);
  if (begin == end) return;

  // Straight from the pieces of the same slicing when they cover the range.
  if (t.shape == want) {
    int64_t covered = 0;
    for (const Piece& pc : t.pieces) {
      if (!same_slicing(pc.shard, p.shard)) continue;
      const auto [lo, hi] = intersect({pc.begin, pc.end}, {begin, end});
      if (lo >= hi) continue;
      copy_piece(name, pc, lo, hi, dst + (lo - begin));
      covered += hi - lo;
    }
    if (covered == end - begin) return;
  }

  // Otherwise through the whole stored tensor, assembled from every piece
  // (each checked against its file first, so the size allocated is data
  // that is there).
  const Shape stored = to_shape(t.shape);
  const int64_t total = stored.numel();
  int64_t covered = 0;
  for (const Piece& pc : t.pieces) covered += (entry(name, pc), pc.end - pc.begin);
  LOOM_CHECK_KIND(kData, covered == total,
                  "{}: the pieces of '{}' hold {} of its {} elements (a rank's file missing from "
                  "the manifest?)",
                  where_, name, covered, total);
  Buffer whole_buf(static_cast<size_t>(total) * sizeof(float), MemCategory::kWorkspace);
  float* whole = whole_buf.as<float>();
  std::vector<float> chunk;
  for (const Piece& pc : t.pieces) {
    if (unsharded(pc.shard)) {
      copy_piece(name, pc, pc.begin, pc.end, whole + pc.begin);
    } else {
      constexpr int64_t kChunk = 1 << 16;
      chunk.resize(static_cast<size_t>(std::min(kChunk, pc.end - pc.begin)));
      for (int64_t b = pc.begin; b < pc.end; b += kChunk) {
        const int64_t e = std::min(pc.end, b + kChunk);
        copy_piece(name, pc, b, e, chunk.data());
        for (int64_t i = b; i < e; ++i)
          whole[shard_global_index(stored, pc.shard, i)] = chunk[static_cast<size_t>(i - b)];
      }
    }
  }
  const int64_t cols = want[0] > 0 ? p.shape.numel() / want[0] : 1;
  const int64_t rows = t.shape[0];
  for (int64_t i = begin; i < end; ++i) {
    const int64_t g = shard_global_index(p.shape, p.shard, i);
    dst[i - begin] = g / cols < rows ? whole[g] : 0.0f;
  }
}

}  // namespace loom
