// Config validation: every error names the key (or file position) and the
// reason; defaults and the batch identity resolve as DeepSpeed's do.
#include <gtest/gtest.h>

#include <cmath>

#include "loom/core/error.h"
#include "loom/train/config.h"
#include "test_util.h"

namespace loom {
namespace {

const char* kBase = R"({
  "train_micro_batch_size_per_gpu": 4,
  "model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32},
  "data": {"synthetic": true}
})";

std::string error_of(const std::string& text, std::vector<std::string> overrides = {},
                     int world = 1) {
  return test::error_of([&] { parse_config(text, "cfg.json", overrides, world); });
}

TEST(Config, ResolvesDefaults) {
  Config c = parse_config(kBase, "cfg.json", {});
  EXPECT_EQ(c.micro_batch, 4);
  EXPECT_EQ(c.grad_accum, 1);
  EXPECT_EQ(c.train_batch_size, 4);
  EXPECT_EQ(c.model.padded_vocab(), 256);
  EXPECT_EQ(c.optimizer.type, "AdamW");
  EXPECT_EQ(c.resolved["model"]["n_embd"], 64);
  EXPECT_EQ(c.resolved["train_batch_size"], 4);
  EXPECT_TRUE(c.resolved["data"]["synthetic"].get<bool>());
}

TEST(Config, InvalidJsonGivesLineAndColumn) {
  std::string e = error_of("{\n  \"model\": {\n    \"n_layer\": 2,,\n  }\n}");
  EXPECT_HAS(e, "cfg.json: invalid JSON at line 3, column 18");
}

TEST(Config, UnknownKeySuggestsTheNearest) {
  std::string e = error_of(R"({"train_micro_batch_size_per_gpu": 4, "data": {"synthetic": true},
                              "model": {"n_embed": 64}})");
  EXPECT_HAS(e, "unknown key 'model.n_embed' (did you mean 'model.n_embd'?)");
  e = error_of(R"({"train_micro_batch_size_per_gpu": 4, "gradient_acumulation_steps": 2})");
  EXPECT_HAS(e, "did you mean 'gradient_accumulation_steps'?");
  e = error_of(R"({"zzz": 1})");
  EXPECT_HAS(e, "unknown key 'zzz'");
}

TEST(Config, WrongTypesAndRangesNameTheKeyPath) {
  EXPECT_HAS(error_of(R"({"model": {"n_layer": "four"}})"),
             "model.n_layer: expected an integer, got a string \"four\"");
  EXPECT_HAS(error_of(R"({"model": {"n_layer": 0}})"),
             "model.n_layer: 0 is out of range (must be >= 1");
  EXPECT_HAS(error_of(R"({"model": {"seq_len": -5}})"), "model.seq_len: -5 is out of range");
  EXPECT_HAS(error_of(R"({"model": 3})"), "model: expected an object");
  EXPECT_HAS(error_of(R"({"optimizer": {"params": {"betas": [0.9]}}})"),
             "optimizer.params.betas: expected a list of two numbers");
  EXPECT_HAS(error_of(R"({"scheduler": {"type": "Cosine"}})"),
             "scheduler.type: unknown value \"Cosine\" (expected one of WarmupLR, WarmupDecayLR, "
             "WarmupCosineLR)");
  EXPECT_HAS(error_of(R"({"model": {"dropout": 1.5}})"), "model.dropout: 1.5 is out of range");
  // Whole floats count as integers and are range-checked like them (0.0
  // once reached a division, -4.0 and 1e300 integer conversions).
  EXPECT_HAS(error_of(kBase, {"model.n_head=0.0"}),
             "model.n_head: 0.0 is out of range (must be >= 1");
  EXPECT_HAS(error_of(kBase, {"model.n_head=-4.0"}), "model.n_head: -4.0 is out of range");
  EXPECT_HAS(error_of(kBase, {"train.steps=1e300"}), "train.steps: 1e+300 is out of range");
  EXPECT_HAS(error_of(kBase, {"model.n_layer=2.5"}), "model.n_layer: expected an integer, got");
  EXPECT_EQ(error_of(kBase, {"model.n_layer=2.0"}), "(no error)");
  // Found by fuzzing: bytes that are not UTF-8 in a value (a message or
  // config.resolved.json would throw dumping them), a top level that is not
  // an object under --set.
  EXPECT_HAS(error_of(kBase, {"parallel.schedule=\x8a\xff"}),
             "parallel.schedule: \"\xef\xbf\xbd\xef\xbf\xbd\" is not valid UTF-8");
  EXPECT_HAS(error_of(kBase, {"train.name=\xc3"}), "train.name: ");
  EXPECT_HAS(error_of("[1, 2]", {"model.n_layer=2"}), "the top level: expected an object, got");
  EXPECT_HAS(error_of(R"({"train_batch_size": 1e999})"), "cfg.json: invalid JSON: ");
}

TEST(Config, HeadsMustDivideWidth) {
  EXPECT_HAS(error_of(kBase, {"model.n_embd=100", "model.n_head=3"}),
             "cfg.json: model.n_embd 100 is not divisible by model.n_head 3");
}

TEST(Config, BatchIdentity) {
  std::string e = error_of(kBase, {"train_batch_size=32", "gradient_accumulation_steps=2"});
  EXPECT_HAS(e,
             "train_batch_size 32 != train_micro_batch_size_per_gpu 4 x "
             "gradient_accumulation_steps 2 x data-parallel size 1 (= 8)");
  Config c = parse_config(R"({"train_batch_size": 32, "gradient_accumulation_steps": 4,
                              "data": {"synthetic": true}})",
                          "x", {});
  EXPECT_EQ(c.micro_batch, 8);
  c = parse_config(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                       "data": {"synthetic": true}})",
                   "x", {});
  EXPECT_EQ(c.grad_accum, 8);
  EXPECT_HAS(error_of(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                          "data": {"synthetic": true}})"),
             "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4");
  EXPECT_HAS(error_of(R"({"data": {"synthetic": true}})"), "no batch size");
  EXPECT_HAS(error_of(kBase, {"parallel.data=2"}), "parallel.data is 2 but the job has 1 rank(s)");
}

TEST(Config, OverridesApplyAndAreValidated) {
  Config c = parse_config(kBase, "cfg.json", {"model.n_layer=5", "train.name=abc", "log.every=7"});
  EXPECT_EQ(c.model.n_layer, 5);
  EXPECT_EQ(c.train.name, "abc");
  EXPECT_EQ(c.log.every, 7);
  EXPECT_HAS(error_of(kBase, {"model.n_layers=5"}), "did you mean 'model.n_layer'?");
  EXPECT_HAS(error_of(kBase, {"model.n_layer"}), "--set model.n_layer: expected key=value");
  EXPECT_HAS(error_of(kBase, {"model.n_layer=x"}), "model.n_layer: expected an integer");
}

TEST(Config, ZeroKeysAndTheirErrors) {
  Config c = parse_config(
      kBase, "cfg.json",
      {"zero_optimization.stage=3", "zero_optimization.stage3_prefetch_bucket_size=5000",
       "zero_optimization.offload_optimizer.device=cpu"});
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.prefetch_bucket_size, 5000);
  EXPECT_EQ(c.zero.persistence_threshold, 100000);
  EXPECT_EQ(c.resolved["zero_optimization"]["offload_optimizer"]["device"], "cpu");
  EXPECT_HAS(error_of(kBase, {"zero_optimization.stage=4"}),
             "zero_optimization.stage: 4 is out of range");
  EXPECT_HAS(error_of(kBase, {"zero_optimization.reduce_bucket_size=0"}),
             "zero_optimization.reduce_bucket_size: 0 is out of range");
  EXPECT_HAS(error_of(kBase, {"zero_optimization.offload_optimizer.device=disk"}),
             "zero_optimization.offload_optimizer.device: unknown value \"disk\"");
  EXPECT_HAS(error_of(kBase, {"zero_optimization.offload_optimizer.device=cpu"}),
             "offload_optimizer.device cpu needs stage 1, 2 or 3 (stage is 0)");
  const std::vector<std::string> nvme = {"zero_optimization.stage=2",
                                         "zero_optimization.offload_optimizer.device=nvme"};
  EXPECT_HAS(error_of(kBase, nvme),
             "cfg.json: zero_optimization.offload_optimizer.nvme_path is empty");
  auto with_path = [&](const std::string& p) {
    auto o = nvme;
    o.push_back("zero_optimization.offload_optimizer.nvme_path=" + p);
    return error_of(kBase, o);
  };
  EXPECT_HAS(with_path("/nonexistent/loom"),
             "zero_optimization.offload_optimizer.nvme_path: /nonexistent/loom is not an "
             "existing folder");
  // Not writable even for root: /proc refuses new files.
  EXPECT_HAS(with_path("/proc"),
             "zero_optimization.offload_optimizer.nvme_path: cannot create files in /proc");
  test::TempDir dir;
  EXPECT_EQ(with_path(dir.path.string()), "(no error)");
}

TEST(Config, DataAndPrecisionErrors) {
  EXPECT_HAS(error_of(R"({"train_batch_size": 4})"), "data.train: no token file given");
  EXPECT_HAS(error_of(kBase, {"fp16.enabled=true"}), "fp16/bf16 training is not supported");
}

TEST(LrSchedule, MatchesDeepSpeedFormulas) {
  SchedulerConfig s;
  EXPECT_EQ(learning_rate(s, 0.5, 10), 0.5);  // constant
  s.type = "WarmupLR";
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 1.0;
  s.warmup_num_steps = 100;
  s.warmup_type = "log";
  EXPECT_DOUBLE_EQ(learning_rate(s, 0, 0), 0.0);
  EXPECT_DOUBLE_EQ(learning_rate(s, 0, 9), std::log(10.0) / std::log(100.0));
  EXPECT_DOUBLE_EQ(learning_rate(s, 0, 100), 1.0);
  s.warmup_type = "linear";
  EXPECT_DOUBLE_EQ(learning_rate(s, 0, 25), 0.25);
  s.type = "WarmupDecayLR";
  s.total_num_steps = 200;
  EXPECT_DOUBLE_EQ(learning_rate(s, 0, 150), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(s, 0, 250), 0.0);
  s.type = "WarmupCosineLR";
  s.warmup_min_ratio = 0.1;
  s.cos_min_ratio = 0.0;
  EXPECT_DOUBLE_EQ(learning_rate(s, 2.0, 0), 0.2);
  EXPECT_DOUBLE_EQ(learning_rate(s, 2.0, 50), 2.0 * (0.1 + 0.9 * 0.5));
  EXPECT_NEAR(learning_rate(s, 2.0, 150), 1.0, 1e-12);  // half-way down the cosine
  EXPECT_NEAR(learning_rate(s, 2.0, 200), 0.0, 1e-12);
}

}  // namespace
}  // namespace loom
