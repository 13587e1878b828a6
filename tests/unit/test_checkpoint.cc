// Checkpoints and safetensors: round trips, verification, and every kind of
// damaged file rejected with its name and the reason.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/sharded.h"
#include "loom/core/error.h"
#include "loom/infer/generate.h"
#include "loom/io/fs.h"
#include "loom/io/safetensors.h"
#include "loom/io/sha256.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

using test::TempDir;

GptConfig small() {
  GptConfig c;
  c.n_layer = 2, c.n_embd = 16, c.n_head = 2, c.vocab_size = 50, c.seq_len = 8;
  return c;
}

using test::error_of;

TEST(Checkpoint, RoundTripRestoresParamsMomentsAndState) {
  TempDir tmp;
  GptStage<float> a(small());
  a.init(1);
  AdamW opt(a.layout(), OptimizerConfig{});
  for (int64_t i = 0; i < a.num_params(); ++i) {
    opt.exp_avg()[i] = 0.001f * static_cast<float>(i % 97);
    opt.exp_avg_sq()[i] = 0.002f * static_cast<float>(i % 89);
  }
  // wte's vocabulary padding rows never get a gradient, so their moments stay
  // zero; checkpoints hold the real rows only.
  const Param& wte = a.layout().find("transformer.wte.weight");
  for (int64_t i = 50 * 16; i < wte.numel; ++i)
    opt.exp_avg()[wte.offset + i] = opt.exp_avg_sq()[wte.offset + i] = 0.0f;
  TrainerState st{7, 0.5, 1.0, 1, "byte"};
  std::string dir =
      save_checkpoint(tmp.path.string(), a, opt.exp_avg(), opt.exp_avg_sq(), st, {{"model", 1}}, 0);
  EXPECT_EQ(fs::path(dir).filename(), "step-00000007");
  EXPECT_EQ(resolve_checkpoint("latest", tmp.path.string()), dir);

  GptStage<float> b(small());
  AdamW opt_b(b.layout(), OptimizerConfig{});
  TrainerState got = load_checkpoint(dir, b, opt_b.exp_avg(), opt_b.exp_avg_sq());
  EXPECT_EQ(got.step, 7);
  EXPECT_EQ(got.tokenizer, "byte");
  EXPECT_EQ(std::memcmp(a.params(), b.params(), a.num_params() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(opt.exp_avg(), opt_b.exp_avg(), a.num_params() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(opt.exp_avg_sq(), opt_b.exp_avg_sq(), a.num_params() * sizeof(float)), 0);

  // Hugging Face names and shapes: Conv1D (in, out), wte unpadded, lm_head tied.
  SafetensorsFile f((fs::path(dir) / "model.safetensors").string());
  EXPECT_EQ(f.find("transformer.wte.weight")->shape, (std::vector<int64_t>{50, 16}));
  EXPECT_EQ(f.find("transformer.h.1.attn.c_attn.weight")->shape, (std::vector<int64_t>{16, 48}));
  EXPECT_EQ(f.find("lm_head.weight")->shape, (std::vector<int64_t>{50, 16}));
  EXPECT_EQ(f.entries().size(), 2u + 24u + 2u + 1u);
}

TEST(Checkpoint, KeepLastPrunesAndChecksumsCatchDamage) {
  TempDir tmp;
  GptStage<float> m(small());
  m.init(2);
  for (int64_t s = 1; s <= 4; ++s)
    save_checkpoint(tmp.path.string(), m, nullptr, nullptr, TrainerState{s, 0, 1, 2, ""}, {}, 2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp.path)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step-00000003", "step-00000004"}));

  fs::path model = tmp.path / "step-00000004" / "model.safetensors";
  std::string bytes = read_file(model.string());
  bytes[bytes.size() - 3] ^= 0x40;
  std::ofstream(model, std::ios::binary) << bytes;
  GptStage<float> other(small());
  EXPECT_HAS(error_of([&] { load_checkpoint((tmp.path / "step-00000004").string(), other); }),
             "model.safetensors: checksum mismatch");
  fs::remove(tmp.path / "step-00000003" / "manifest.json");
  EXPECT_HAS(error_of([&] { verify_checkpoint((tmp.path / "step-00000003").string()); }),
             "no manifest.json");
}

// A save never leaves `latest` naming a missing or partial folder, and the
// checkpoint just written is never pruned, whatever else is in the folder.
TEST(Checkpoint, SavesReplaceAtomicallyAndNeverPruneTheNewOne) {
  TempDir tmp;
  GptStage<float> m(small());
  m.init(2);
  const std::string root = tmp.path.string();
  auto names = [&] {
    std::vector<std::string> n;
    for (const auto& e : fs::directory_iterator(tmp.path)) n.push_back(e.path().filename());
    std::sort(n.begin(), n.end());
    return n;
  };
  // An older run left step 10; this one saves step 4 with keep_last 1.
  save_checkpoint(root, m, nullptr, nullptr, TrainerState{10, 0, 1, 2, ""}, {}, 0);
  const std::string four =
      save_checkpoint(root, m, nullptr, nullptr, TrainerState{4, 0, 1, 2, ""}, {}, 1);
  EXPECT_EQ(names(), (std::vector<std::string>{"latest", "step-00000004"}));
  EXPECT_EQ(resolve_checkpoint("latest", root), four);
  // The same step again (latest names it): replaced whole, nothing left over.
  m.init(3);
  save_checkpoint(root, m, nullptr, nullptr, TrainerState{4, 0, 1, 2, ""}, {}, 1);
  EXPECT_EQ(names(), (std::vector<std::string>{"latest", "step-00000004"}));
  verify_checkpoint(four);
  GptStage<float> back(small());
  back.init(9);
  load_checkpoint(four, back);
  EXPECT_EQ(std::memcmp(back.params(), m.params(), m.num_params() * sizeof(float)), 0);
}

TEST(Checkpoint, DamagedManifestsAndStatesNameTheFileAndField) {
  TempDir tmp;
  GptStage<float> m(small());
  m.init(2);
  const std::string dir =
      save_checkpoint(tmp.path.string(), m, nullptr, nullptr, TrainerState{1, 0, 1, 2, ""}, {}, 0);
  const std::string manifest = (fs::path(dir) / "manifest.json").string();
  const std::string good = read_file(manifest);
  auto verify_with = [&](const std::string& text) {
    std::ofstream(manifest, std::ios::binary) << text;
    return error_of([&] { verify_checkpoint(dir); });
  };
  EXPECT_HAS(verify_with(R"({"files": {}})"), "manifest.json: lists no trainer_state.json");
  EXPECT_HAS(verify_with(R"({"format": 1})"), "manifest.json: field 'files' is missing");
  EXPECT_HAS(verify_with("{not json"), "manifest.json: not valid JSON");
  nlohmann::json j = nlohmann::json::parse(good);
  j["files"]["model.safetensors"]["bytes"] = "many";
  EXPECT_HAS(
      verify_with(j.dump()),
      "manifest.json files.model.safetensors: field 'bytes' is of the wrong type (\"many\")");
  j = nlohmann::json::parse(good);
  j["files"]["../escape"] = {{"bytes", 1}, {"sha256", "x"}};
  EXPECT_HAS(verify_with(j.dump()), "file name '../escape' leaves the folder");
  std::ofstream(manifest, std::ios::binary) << good;
  verify_checkpoint(dir);
  const std::string state = (fs::path(dir) / "trainer_state.json").string();
  std::ofstream(state, std::ios::binary) << R"({"step": 3, "lr": 0.1})";
  EXPECT_HAS(error_of([&] { read_trainer_state(dir); }),
             "trainer_state.json: field 'loss_scale' is missing");
  // Found by fuzzing: a float beyond int64 was converted with undefined behaviour.
  std::ofstream(state, std::ios::binary) << R"({"step": 8649e94})";
  EXPECT_HAS(error_of([&] { read_trainer_state(dir); }),
             "trainer_state.json: field 'step' is of the wrong type (8.649e+97)");
  std::ofstream(state, std::ios::binary)
      << R"({"step": 1, "lr": 0, "loss_scale": 1, "seed": -3, "tokenizer": ""})";
  EXPECT_HAS(error_of([&] { read_trainer_state(dir); }),
             "trainer_state.json: field 'seed' is of the wrong type (-3)");
  std::ofstream(state, std::ios::binary) << R"({"step": "x"})";
  EXPECT_HAS(error_of([&] { read_trainer_state(dir); }),
             "trainer_state.json: field 'step' is of the wrong type (\"x\")");
}

TEST(Checkpoint, ShapeMismatchNamesTheTensor) {
  TempDir tmp;
  GptStage<float> m(small());
  std::string dir =
      save_checkpoint(tmp.path.string(), m, nullptr, nullptr, TrainerState{1, 0, 1, 0, ""}, {}, 0);
  GptConfig wider = small();
  wider.n_embd = 32;
  GptStage<float> w(wider);
  EXPECT_HAS(error_of([&] { load_checkpoint(dir, w); }),
             "'transformer.wte.weight' has shape [50,16] but the config needs [50,32]");
  GptConfig deeper = small();
  deeper.n_layer = 3;
  GptStage<float> d(deeper);
  EXPECT_HAS(error_of([&] { load_hf_weights(dir + "/model.safetensors", d); }),
             "the file has model.n_layer 2 but the config's model.n_layer is 3");
  GptStage<float> same(small());
  load_hf_weights(dir + "/model.safetensors", same);
  EXPECT_EQ(std::memcmp(same.params(), m.params(), m.num_params() * sizeof(float)), 0);
}

// A raw safetensors file from a header string and a data size.
void write_raw(const fs::path& p, const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out += header + std::string(data_bytes, '\0');
  std::ofstream(p, std::ios::binary) << out;
}

TEST(Safetensors, DamagedFilesAreRejectedWithTheReason) {
  TempDir tmp;
  fs::path p = tmp.path / "x.safetensors";
  auto err = [&] { return error_of([&] { SafetensorsFile f(p.string()); }); };
  write_raw(p, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_EQ(SafetensorsFile(p.string()).entries().size(), 1u);
  std::ofstream(p, std::ios::binary) << std::string("\x10\x00\x00", 3);
  EXPECT_HAS(err(), "truncated safetensors file (3 bytes)");
  std::string big(8, '\0');
  big[0] = 100;
  std::ofstream(p, std::ios::binary) << big + "{}";
  EXPECT_HAS(err(), "header length 100 is beyond the file (10 bytes)");
  write_raw(p, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4);
  EXPECT_HAS(err(), "tensor 'a': data_offsets [0, 8] outside the data (4 bytes; truncated file?)");
  write_raw(p, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                  "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            12);
  EXPECT_HAS(err(), "data_offsets overlap or leave a gap");
  write_raw(p, R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,8]}})", 8);
  EXPECT_HAS(err(), "tensor 'a': 8 bytes for shape [2] of F16 (expected 4)");
  write_raw(p, R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8);
  EXPECT_HAS(err(), "tensor 'a': unsupported dtype \"I64\"");
  write_raw(p, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8);
  EXPECT_HAS(err(), "4 trailing bytes after the last tensor");
  write_raw(p, "not json", 0);
  EXPECT_HAS(err(), "header is not a JSON object");
  // Dimensions whose product wraps around 2^64 to the data's 8 bytes
  // (2^62 x 2^2 elements x 4 bytes = 2^66 = 0 mod 2^64, + 2 x 4).
  write_raw(p, R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", 0);
  EXPECT_HAS(err(), "tensor 'a': shape [4611686018427387904,4] has more elements than memory");
  write_raw(p, R"({"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})", 4);
  EXPECT_HAS(err(), "tensor 'a': bad shape [18446744073709551615]");
  write_raw(p, R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8);
  EXPECT_HAS(err(), "tensor 'a': bad shape [-2]");
  std::string huge(8, '\0');
  const uint64_t claimed = 200'000'000;
  std::memcpy(huge.data(), &claimed, 8);
  std::ofstream(p, std::ios::binary) << huge + "{}";
  EXPECT_HAS(err(), "header length 200000000 exceeds the 100 MB a safetensors header may have");
}

TEST(Generate, GreedyIsDeterministicAndSurvivesAFullContext) {
  GptStage<float> m(small());
  m.init(9);
  SampleOptions greedy{20, 0.0, 0, 1};  // 20 > seq_len 8: the cache restarts
  auto a = generate(m, {1, 2, 3}, greedy);
  auto b = generate(m, {1, 2, 3}, greedy);
  EXPECT_EQ(a.size(), 20u);
  EXPECT_EQ(a, b);
  SampleOptions sampled{20, 1.0, 10, 5};
  EXPECT_EQ(generate(m, {4}, sampled), generate(m, {4}, sampled));
  EXPECT_HAS(error_of([&] { generate(m, {60}, greedy); }), "prompt token 60 is beyond");
}

// SHA-256 against FIPS 180-2's vectors, in one update or many, and of a
// file read in pieces.
TEST(Sha256, MatchesTheStandardsVectorsAndReadsFilesInPieces) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string million(1000000, 'a');
  EXPECT_EQ(sha256_hex(million),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  Sha256 h;
  for (size_t i = 0; i < million.size(); i += 777)
    h.update(million.data() + i, std::min<size_t>(777, million.size() - i));
  EXPECT_EQ(h.hex_digest(), sha256_hex(million));
  TempDir tmp;
  const std::string big = million + million + "b";  // more than one read
  write_file_atomic((tmp.path / "f").string(), big);
  size_t bytes = 0;
  EXPECT_EQ(sha256_file((tmp.path / "f").string(), &bytes), sha256_hex(big));
  EXPECT_EQ(bytes, big.size());
  EXPECT_HAS(error_of([&] { sha256_file((tmp.path / "none").string(), &bytes); }),
             "none: cannot open");
}

// Sharded checkpoints: a tensor written as pieces of one slicing (ranges of
// each rank's slice cut anywhere, as ZeRO cuts them) reads back into any
// other slicing and range, straight from matching pieces or through the
// whole tensor; the manifest's damage is named.
struct ShardedFixture {
  TempDir tmp;
  Shape global{6, 8};
  std::vector<float> whole;  // the global tensor: element i is i + 0.5
  // Params that describe each slicing of it.
  std::vector<Param> params;
  ShardedFixture() {
    for (int64_t i = 0; i < global.numel(); ++i) whole.push_back(static_cast<float>(i) + 0.5f);
  }
  Param param(ShardSpec s) {
    Param p;
    p.name = "transformer.h.0.mlp.c_fc.weight";
    p.shape = global;
    p.shard = s;
    p.local = shard_shape(global, s);
    p.numel = p.local.numel();
    return p;
  }
  // Writes the slices of `count` ranks split as `make(r)`, each slice cut
  // into two pieces at `cut` (in the slice), rank r to rank-r's file, and
  // the manifest; returns the folder.
  std::string write(const std::function<ShardSpec(int)>& make, int count, int64_t cut) {
    std::vector<std::vector<float>> locals(static_cast<size_t>(count));
    params.clear();
    for (int r = 0; r < count; ++r) params.push_back(param(make(r)));
    nlohmann::json files = nlohmann::json::object();
    for (int r = 0; r < count; ++r) {
      const Param& p = params[static_cast<size_t>(r)];
      locals[static_cast<size_t>(r)].resize(static_cast<size_t>(p.numel));
      shard_from_global(global, p.shard, whole.data(), locals[static_cast<size_t>(r)].data());
      // Two ranks' files hold the two pieces of this slice: [0, cut) and [cut, n).
      const float* d = locals[static_cast<size_t>(r)].data();
      std::vector<PieceOut> a = {{p.name, &p, 0, cut, d}};
      ShardFileInfo info = write_shard_file(tmp.path.string(), 2 * r, a);
      files[shard_file_name(2 * r)] = {{"bytes", info.bytes}, {"sha256", info.sha256}};
      std::vector<PieceOut> rest = {{p.name, &p, cut, p.numel, d + cut}};
      info = write_shard_file(tmp.path.string(), 2 * r + 1, rest);
      files[shard_file_name(2 * r + 1)] = {{"bytes", info.bytes}, {"sha256", info.sha256}};
    }
    nlohmann::json m = {{"format", "loom checkpoint v2"},
                        {"files", files},
                        {"tensors", index_shard_files(tmp.path.string(), 2 * count)}};
    write_file_atomic((tmp.path / "manifest.json").string(), m.dump());
    return tmp.path.string();
  }
  // What a reader gives for elements [b, e) of slicing s.
  std::vector<float> read(const std::string& dir, ShardSpec s, int64_t b, int64_t e) {
    const Param p = param(s);
    std::vector<float> got(static_cast<size_t>(e - b), -1.0f);
    CheckpointReader(dir).read(p.name, p, b, e, got.data());
    return got;
  }
  std::vector<float> expect(ShardSpec s, int64_t b, int64_t e) {
    std::vector<float> out;
    for (int64_t i = b; i < e; ++i)
      out.push_back(whole[static_cast<size_t>(shard_global_index(global, s, i))]);
    return out;
  }
};

TEST(ShardedCheckpoint, PiecesOfAnySlicingReadIntoAnyOther) {
  ShardedFixture f;
  // Saved column-split over 2 ranks, each slice cut at 5 (not a row boundary).
  const std::string dir = f.write([](int r) { return ShardSpec::split(1, r, 2); }, 2, 5);
  struct Case {
    ShardSpec s;
    int64_t b, e;
  };
  for (const Case& c : {Case{ShardSpec::split(1, 1, 2), 0, 24},  // same slicing, whole slice
                        Case{ShardSpec::split(1, 0, 2), 3, 17},  // same slicing, across pieces
                        Case{ShardSpec::whole(), 0, 48},         // one process
                        Case{ShardSpec::whole(), 7, 31},         // a ZeRO range of it
                        Case{ShardSpec::split(0, 1, 2), 2, 20},  // rows instead of columns
                        Case{ShardSpec::split(1, 3, 4), 0, 12},  // more ranks
                        Case{ShardSpec::heads(1, 1, 2, 2), 1, 23}})
    EXPECT_EQ(f.read(dir, c.s, c.b, c.e), f.expect(c.s, c.b, c.e))
        << c.s.describe() << " [" << c.b << ", " << c.e << ")";
  // And the other way: saved whole in pieces, read as a column slice.
  ShardedFixture g;
  const std::string dir2 = g.write([](int) { return ShardSpec::whole(); }, 1, 29);
  EXPECT_EQ(g.read(dir2, ShardSpec::split(1, 1, 2), 0, 24),
            g.expect(ShardSpec::split(1, 1, 2), 0, 24));
}

TEST(ShardedCheckpoint, DamagedManifestsNameTheTensorAndTheReason) {
  ShardedFixture f;
  const std::string dir = f.write([](int r) { return ShardSpec::split(1, r, 2); }, 2, 5);
  const std::string mpath = dir + "/manifest.json";
  const nlohmann::json good = read_json_file(mpath);
  const std::string t = "transformer.h.0.mlp.c_fc.weight";
  auto with = [&](const std::function<void(nlohmann::json&)>& damage) {
    nlohmann::json m = good;
    damage(m);
    write_file_atomic(mpath, m.dump());
    return error_of([&] { f.read(dir, ShardSpec::whole(), 0, 48); });
  };
  EXPECT_HAS(with([&](nlohmann::json& m) { m["tensors"][t]["pieces"].erase(3); }),
             "tensors." + t + ": the pieces hold 29 of its 48 elements");
  EXPECT_HAS(with([&](nlohmann::json& m) { m["tensors"][t]["pieces"][1]["range"][0] = 4; }),
             "pieces [0, 5) and [4, 24) overlap");
  EXPECT_HAS(with([&](nlohmann::json& m) { m["tensors"][t]["pieces"][0]["shard"]["kind"] = "x"; }),
             "unknown slicing 'x'");
  EXPECT_HAS(with([&](nlohmann::json& m) { m["tensors"][t]["pieces"][0]["shard"]["index"] = 2; }),
             "shard.index: expected a whole number in [0, 1], got 2");
  EXPECT_HAS(with([&](nlohmann::json& m) { m["tensors"][t]["pieces"][0]["range"][1] = 25; }),
             "range: expected a whole number in [0, 24], got 25");
  EXPECT_HAS(with([&](nlohmann::json& m) { m["tensors"][t]["pieces"][0]["file"] = "x.bin"; }),
             "piece in 'x.bin', which 'files' does not list");
  EXPECT_HAS(with([&](nlohmann::json& m) {
               m["tensors"][t]["shape"] = {8, 6};
             }),
             "has shape [8,6] but the config needs [6,8]");
  EXPECT_HAS(with([&](nlohmann::json& m) { m["format"] = 2; }), "field 'format' is not a string");
  EXPECT_HAS(with([&](nlohmann::json& m) {
               m["tensors"][t]["shape"] = {6, 7};
             }),
             "slicing does not fit shape [6,7]");
}

}  // namespace
}  // namespace loom
