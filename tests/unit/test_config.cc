// Config validation: every error names the key (or file position) and the
// reason; defaults and the batch identity resolve as DeepSpeed's do.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "loom/core/error.h"
#include "loom/io/fs.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/train/config.h"
#include "loom/train/config_keys.h"
#include "loom/train/gemm_choice.h"
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

// Each batch key is checked alone against ~9e15; their products are
// checked for overflow instead of wrapping into a wrong identity.
TEST(Config, BatchProductsThatOverflowAreErrors) {
  EXPECT_HAS(error_of(kBase, {"train_micro_batch_size_per_gpu=3000000000000000",
                              "gradient_accumulation_steps=3000000000000000"}),
             "micro x accumulation x data-parallel = 3000000000000000 x 3000000000000000 "
             "overflows a 64-bit count");
  EXPECT_HAS(
      error_of(kBase, {"train_micro_batch_size_per_gpu=3000000000000000", "model.seq_len=1048576"}),
      "tokens per step: train_batch_size x model.seq_len = 3000000000000000 x 1048576 "
      "overflows");
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

TEST(Config, CompressionKeysAndTheirErrors) {
  Config c = parse_config(kBase, "cfg.json",
                          {"comm.compression.type=powersgd", "comm.compression.rank=4",
                           "comm.compression.warm_start=false"});
  EXPECT_EQ(c.zero.compression.type, "powersgd");
  EXPECT_EQ(c.zero.compression.rank, 4);
  EXPECT_EQ(c.zero.compression.start_iter, 10);  // PyTorch's defaults
  EXPECT_EQ(c.zero.compression.min_compression_rate, 2.0);
  EXPECT_TRUE(c.zero.compression.error_feedback);
  EXPECT_FALSE(c.zero.compression.warm_start);
  EXPECT_EQ(c.resolved["comm"]["compression"]["rank"], 4);
  EXPECT_HAS(error_of(kBase, {"comm.compression.type=topk"}),
             "comm.compression.type: unknown value \"topk\"");
  for (const char* stage : {"zero_optimization.stage=2", "zero_optimization.stage=3"})
    EXPECT_EQ(error_of(kBase, {"comm.compression.type=powersgd", stage}), "(no error)") << stage;
  EXPECT_HAS(error_of(kBase, {"comm.compression.type=fp16", "bf16.enabled=true"}),
             "comm.compression.type fp16: the gradients of a bf16 run are already 16-bit");
  EXPECT_HAS(error_of(kBase, {"comm.compression.type=powersgd", "checkpoint.format=whole"}),
             "only sharded checkpoints hold");
  EXPECT_HAS(error_of(kBase, {"comm.compression.type=powersgd", "fp16.enabled=true"}),
             "comm.compression.type powersgd with fp16.enabled: the dynamic loss scale");
  EXPECT_HAS(error_of(kBase, {"comm.compression.type=bf16", "comm.allreduce=ring"}),
             "comm.compression.type bf16 with comm.allreduce ring: that algorithm reduces f32");
  EXPECT_HAS(error_of(kBase, {"optimizer.type=OneBitAdam", "optimizer.params.freeze_step=0"}),
             "optimizer.params.freeze_step: 0 is out of range");

  Config o = parse_config(kBase, "cfg.json",
                          {"optimizer.type=OneBitAdam", "optimizer.params.freeze_step=30",
                           "optimizer.params.cuda_aware=true"});
  EXPECT_EQ(o.optimizer.freeze_step, 30);
  EXPECT_EQ(o.resolved["optimizer"]["params"]["comm_backend_name"], "mpi");
  EXPECT_EQ(error_of(kBase, {"optimizer.type=OneBitAdam", "zero_optimization.stage=1"}),
            "(no error)");
  EXPECT_HAS(error_of(kBase, {"optimizer.type=OneBitAdam", "zero_optimization.stage=2"}),
             "optimizer.type OneBitAdam needs zero_optimization.stage 0 or 1 (stage is 2)");
  EXPECT_HAS(error_of(kBase, {"optimizer.type=ZeroOneAdam", "zero_optimization.stage=1",
                              "optimizer.params.var_freeze_step=10",
                              "optimizer.params.local_step_scaler=20", "train.steps=40"}),
             "train.steps 40 reaches the local steps (after step var_freeze_step 10 + "
             "local_step_scaler 20)");
  // With local_step_clipper 1 the interval never grows: no local steps to refuse.
  EXPECT_EQ(error_of(kBase, {"optimizer.type=ZeroOneAdam", "zero_optimization.stage=1",
                             "optimizer.params.var_freeze_step=10",
                             "optimizer.params.local_step_scaler=20",
                             "optimizer.params.local_step_clipper=1", "train.steps=40"}),
            "(no error)");
  EXPECT_HAS(error_of(kBase,
                      {"optimizer.type=ZeroOneAdam", "parallel.context=2", "model.seq_len=64",
                       "optimizer.params.var_freeze_step=10",
                       "optimizer.params.local_step_scaler=20", "train.steps=40"},
                      2),
             "optimizer.type ZeroOneAdam with parallel.context 2: train.steps 40 reaches the local "
             "steps");
  EXPECT_HAS(error_of(kBase, {"optimizer.type=OneBitAdam", "zero_optimization.stage=1",
                              "zero_optimization.offload_optimizer.device=nvme",
                              "zero_optimization.offload_optimizer.nvme_path=/tmp"}),
             "optimizer.type OneBitAdam with zero_optimization.offload_optimizer.device nvme: the "
             "1-bit update reads and writes the moments in memory");
  EXPECT_HAS(error_of(kBase, {"optimizer.type=OneBitAdam", "comm.compression.type=bf16"}),
             "the optimizer compresses what it communicates itself");
  EXPECT_HAS(
      error_of(kBase, {"optimizer.type=OneBitAdam", "optimizer.params.comm_backend_name=nccl"}),
      "optimizer.params.comm_backend_name: unknown value \"nccl\"");
  // 0/1 Adam's local steps run (they begin local_step_scaler steps after the freeze).
  Config z = parse_config(kBase, "cfg.json",
                          {"optimizer.type=ZeroOneAdam", "optimizer.params.var_freeze_step=10",
                           "optimizer.params.local_step_scaler=20",
                           "optimizer.params.local_step_clipper=4", "train.steps=80"});
  EXPECT_EQ(z.optimizer.local_step_scaler, 20);
  EXPECT_EQ(z.optimizer.local_step_clipper, 4);
  EXPECT_HAS(
      error_of(kBase, {"optimizer.type=ZeroOneAdam", "optimizer.params.local_step_clipper=0"}),
      "optimizer.params.local_step_clipper");
}

TEST(Config, DataAndPrecisionErrors) {
  EXPECT_HAS(error_of(R"({"train_batch_size": 4})"), "data.train: no token file given");
  EXPECT_EQ(error_of(kBase, {"fp16.enabled=true"}), "(no error)");
  EXPECT_EQ(error_of(kBase, {"bf16.enabled=true"}), "(no error)");
  EXPECT_HAS(error_of(kBase, {"kernels.gemm_inputs=16bit"}),
             "kernels.gemm_inputs: 16bit rounds GEMM inputs to the run's 16-bit type; it needs "
             "bf16.enabled or fp16.enabled");
  EXPECT_EQ(error_of(kBase, {"kernels.gemm_inputs=16bit", "fp16.enabled=true"}), "(no error)");
  EXPECT_EQ(parse_config(kBase, "test", {"bf16.enabled=true"}).zero.dtype, DType::kBF16);
  EXPECT_EQ(parse_config(kBase, "test", {"fp16.enabled=true"}).zero.dtype, DType::kF16);
  EXPECT_HAS(error_of(kBase, {"fp16.enabled=true", "bf16.enabled=true"}),
             "fp16.enabled and bf16.enabled are both true; choose one");
  EXPECT_HAS(error_of(kBase, {"fp16.loss_scale=-1"}), "fp16.loss_scale");
  EXPECT_HAS(error_of(kBase, {"fp16.min_loss_scale=65537"}),
             "fp16.min_loss_scale 65537 is above the initial scale 65536 "
             "(2^fp16.initial_scale_power)");
  EXPECT_HAS(error_of(kBase, {"fp16.loss_scale=8", "fp16.min_loss_scale=16"}),
             "is above the initial scale 8 (fp16.loss_scale)");
  EXPECT_HAS(error_of(kBase, {"fp16.hysteresis=0"}), "fp16.hysteresis");
  EXPECT_HAS(error_of(kBase, {"fp16.loss_scale_window=0"}), "fp16.loss_scale_window");
  EXPECT_HAS(error_of(kBase, {"train.on_nonfinite=ignore"}), "train.on_nonfinite");
}

// kernels.gemm_inputs auto: a rule of the precision and the CPU as oneDNN
// sees it (bf16 16-bit exactly where cpu::bf16_matmul_pays: AMX tiles, or an
// AMD CPU's AVX512-BF16); 16bit asked of bf16 where there is no bf16 matmul
// names the ISA. ctest runs it again under ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
// and AVX2 (unit.gemm_inputs.*), where this CPU takes other branches; the
// rule itself is checked on every kind of CPU below.
TEST(Config, GemmInputsAutoFollowsTheCpu) {
  const Config f32 = parse_config(kBase, "test", {});
  EXPECT_EQ(f32.kernels.gemm_inputs, "auto");
  EXPECT_FALSE(f32.kernels.gemm16);
  EXPECT_EQ(f32.kernels.gemm_inputs_why, "f32: an f32 run");
  const Config bf16 = parse_config(kBase, "test", {"bf16.enabled=true"});
  const bool pays = cpu::bf16_matmul_pays_here();
  EXPECT_EQ(bf16.kernels.gemm16, pays);
  EXPECT_EQ(bf16.zero.weights16, bf16.kernels.gemm16);
  EXPECT_HAS(bf16.kernels.gemm_inputs_why,
             pays ? "bf16: auto, oneDNN's bf16 matmul on " : "f32: auto, ");
  const Config fp16 = parse_config(kBase, "test", {"fp16.enabled=true"});
  EXPECT_FALSE(fp16.kernels.gemm16);
  EXPECT_HAS(fp16.kernels.gemm_inputs_why, "no CPU multiplies fp16 natively");
  EXPECT_FALSE(
      parse_config(kBase, "test", {"bf16.enabled=true", "kernels.gemm_inputs=f32"}).kernels.gemm16);
  if (cpu::gemm_16_uses_bf16_matmul(DType::kBF16)) {
    EXPECT_TRUE(parse_config(kBase, "test", {"bf16.enabled=true", "kernels.gemm_inputs=16bit"})
                    .kernels.gemm16);
  } else {
    EXPECT_HAS(error_of(kBase, {"bf16.enabled=true", "kernels.gemm_inputs=16bit"}),
               "kernels.gemm_inputs: 16bit with bf16.enabled: this CPU has no bf16 GEMM "
               "(oneDNN's bf16 matmul does not run at ISA " +
                   cpu::gemm_backend_isa(cpu::GemmBackend::kOneDnn));
  }
  EXPECT_HAS(error_of(kBase, {"kernels.gemm_inputs=bf16"}), "kernels.gemm_inputs");
}

// The rule on each kind of CPU, whatever this one is: bf16 GEMM inputs with
// AMX tiles and on AMD's AVX512-BF16 (measured 2.1x and 1.6x f32 end to end
// on gpt-m), f32 on Intel's AVX512-BF16 without AMX (0.68x with bf16 inputs)
// and wherever no bf16 matmul runs; 16bit refused there by the ISA's name.
TEST(Config, GemmInputsAutoRuleOnEveryKindOfCpu) {
  using cpu::Bf16MatmulFacts;
  // {isa, onednn, runs, amx, native, amd}
  const Bf16MatmulFacts amx{"avx512_core_amx", true, true, true, true, false};
  const Bf16MatmulFacts amd_bf16{"avx512_core_bf16", true, true, false, true, true};
  const Bf16MatmulFacts intel_bf16{"avx512_core_bf16", true, true, false, true, false};
  const Bf16MatmulFacts amd_emulated{"avx512_core", true, true, false, false, true};
  const Bf16MatmulFacts amd_avx2{"avx2", true, false, false, false, true};
  const Bf16MatmulFacts no_onednn{"none", false, false, false, false, false};
  auto a = [](const Bf16MatmulFacts& f) {
    return resolve_gemm_inputs("auto", DType::kBF16, "cpu", f);
  };
  EXPECT_TRUE(a(amx).sixteen);
  EXPECT_EQ(a(amx).why, "bf16: auto, oneDNN's bf16 matmul on AMX tiles (ISA avx512_core_amx)");
  EXPECT_TRUE(a(amd_bf16).sixteen);
  EXPECT_HAS(a(amd_bf16).why,
             "bf16: auto, oneDNN's bf16 matmul on an AMD CPU's AVX512-BF16 "
             "(ISA avx512_core_bf16)");
  EXPECT_FALSE(a(intel_bf16).sixteen);
  EXPECT_HAS(a(intel_bf16).why,
             "f32: auto, ISA avx512_core_bf16 without AMX and not an AMD CPU, where "
             "rounding the operands costs more");
  // oneDNN capped below AVX512-BF16 runs its bf16 matmul by emulation.
  EXPECT_FALSE(a(amd_emulated).sixteen);
  EXPECT_EQ(a(amd_emulated).why,
            "f32: auto, ISA avx512_core emulates the bf16 instructions, where rounding the "
            "operands costs more than its bf16 GEMMs gain");
  EXPECT_FALSE(a(amd_avx2).sixteen);
  EXPECT_EQ(a(amd_avx2).why, "f32: auto, ISA avx2 has no bf16 matmul");
  EXPECT_FALSE(a(no_onednn).sixteen);
  EXPECT_EQ(a(no_onednn).why, "f32: auto, this build has no oneDNN (so no bf16 matmul)");
  // fp16 stays f32 on every CPU; a GPU takes 16-bit inputs.
  EXPECT_FALSE(resolve_gemm_inputs("auto", DType::kF16, "cpu", amx).sixteen);
  EXPECT_TRUE(resolve_gemm_inputs("auto", DType::kBF16, "cuda", no_onednn).sixteen);
  // 16bit: taken wherever a bf16 matmul runs, refused by the ISA where none does.
  EXPECT_TRUE(resolve_gemm_inputs("16bit", DType::kBF16, "cpu", intel_bf16).sixteen);
  EXPECT_EQ(resolve_gemm_inputs("16bit", DType::kBF16, "cpu", intel_bf16).why,
            "bf16, as kernels.gemm_inputs asks (oneDNN's bf16 matmul)");
  try {
    resolve_gemm_inputs("16bit", DType::kBF16, "cpu", amd_avx2);
    ADD_FAILURE() << "16bit without a bf16 matmul was taken";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(),
               "this CPU has no bf16 GEMM (oneDNN's bf16 matmul does not run at ISA "
               "avx2); use auto or f32");
  }
  try {
    resolve_gemm_inputs("16bit", DType::kBF16, "cpu", no_onednn);
    ADD_FAILURE() << "16bit without oneDNN was taken";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "at ISA none, and this build has no oneDNN");
  }
}

TEST(Config, MixtureOfExpertsKeys) {
  const Config c =
      parse_config(kBase, "cfg.json",
                   {"model.moe.num_experts=8", "model.moe.top_k=1", "model.moe.every_n_layers=2",
                    "model.moe.capacity_factor=1.25", "model.moe.aux_loss_coef=0.02"});
  EXPECT_EQ(c.model.moe_experts, 8);
  EXPECT_EQ(c.model.moe_top_k, 1);
  EXPECT_FALSE(c.model.moe_layer(0));
  EXPECT_TRUE(c.model.moe_layer(1));
  EXPECT_EQ(c.resolved["model"]["moe"]["capacity_factor"], 1.25);
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=2", "model.moe.top_k=3"}),
             "model.moe.top_k 3 is larger than model.moe.num_experts 2");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=2", "model.moe.every_n_layers=3"}),
             "model.moe.every_n_layers 3 is more than model.n_layer 2");
  EXPECT_HAS(error_of(kBase, {"model.moe.top_k=2"}), "model.moe needs num_experts");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.aux_loss_coef=-1"}),
             "model.moe.aux_loss_coef");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.routr=hash"}),
             "did you mean 'model.moe.router'");
  // Routers.
  const Config h =
      parse_config(kBase, "cfg.json", {"model.moe.num_experts=4", "model.moe.router=hash"});
  EXPECT_EQ(h.model.moe_router, 1);
  EXPECT_EQ(h.model.moe_aux_loss_coef, 0.0);
  EXPECT_FALSE(h.resolved["model"]["moe"].contains("aux_loss_coef"));
  const Config t = parse_config(
      kBase, "cfg.json",
      {"model.moe.num_experts=4", "model.moe.router=tag", "model.moe.tag_tokens=[5, 9]"});
  EXPECT_EQ(t.model.moe_tag_tokens, (std::vector<int32_t>{5, 9}));
  EXPECT_EQ(t.resolved["model"]["moe"]["tag_tokens"], nlohmann::json({5, 9}));
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.router=tag"}),
             "model.moe.router is tag but model.moe.tag_tokens is not set");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.tag_tokens=[5]"}),
             "model.moe.tag_tokens is set but model.moe.router is learned");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.router=tag",
                              "model.moe.tag_tokens=[5, 1000000]"}),
             "model.moe.tag_tokens: 1000000 is outside the vocabulary");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.router=tag",
                              "model.moe.tag_tokens=[5, 1.5]"}),
             "model.moe.tag_tokens: 1.5 is not an integer");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.router=tag",
                              "model.moe.tag_tokens=[5, 9, 5]"}),
             "model.moe.tag_tokens: 5 is listed twice");
  EXPECT_HAS(
      error_of(kBase,
               {"model.moe.num_experts=4", "parallel.tensor=2", "parallel.sequence_parallel=true"},
               2),
      "parallel.sequence_parallel with mixture-of-experts layers is not supported yet");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.router=hash",
                              "model.moe.aux_loss_coef=0.01"}),
             "model.moe.aux_loss_coef is set but model.moe.router is hash");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.router=hash",
                              "model.moe.balancing=bias"}),
             "bias balancing steers the learned router");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "model.moe.router=random"}),
             "model.moe.router: unknown value \"random\" (expected one of learned, hash, tag)");
  // Expert parallelism.
  EXPECT_HAS(error_of(kBase, {"parallel.expert=2"}, 2),
             "parallel.expert is 2 but the model has no mixture-of-experts layers");
  EXPECT_HAS(error_of(kBase, {"model.moe.num_experts=4", "parallel.expert=2"}),
             "parallel.expert 2 does not divide the data-parallel size 1");
  EXPECT_HAS(
      error_of(kBase, {"model.moe.num_experts=4", "parallel.expert=4", "parallel.tensor=2"}, 4),
      "parallel.expert 4 does not divide the data-parallel size 2");
  EXPECT_HAS(
      error_of(kBase, {"model.moe.num_experts=3", "model.moe.top_k=1", "parallel.expert=2"}, 2),
      "model.moe.num_experts 3 is not divisible by parallel.expert 2");
  EXPECT_EQ(parse_config(kBase, "cfg.json", {"model.moe.num_experts=4", "parallel.expert=2"}, 4)
                .parallel.expert,
            2);
}

// Context parallelism's checks name the numbers and the nearest valid
// choices; a valid cp resolves with dp from what is left.
TEST(Config, ContextParallelism) {
  const Config c = parse_config(kBase, "cfg.json", {"parallel.context=2"}, 4);
  EXPECT_EQ(c.parallel.context, 2);
  EXPECT_EQ(c.data_parallel, 2);
  EXPECT_EQ(c.local_seq_len(), 16);
  EXPECT_EQ(c.parallel.context_comm, "p2p");
  EXPECT_HAS(error_of(kBase, {"parallel.context=4"}, 6),
             "the job's 6 rank(s) do not divide into parallel.tensor 1 x parallel.context 4 x "
             "parallel.pipeline 1");
  EXPECT_HAS(error_of(kBase, {"parallel.context=2", "model.seq_len=30"}, 2),
             "model.seq_len 30 does not divide into 2 x parallel.context 2 = 4 chunks; nearest "
             "valid seq_len: 28 or 32");
  EXPECT_HAS(error_of(kBase, {"parallel.context=8", "model.seq_len=12"}, 8),
             "model.seq_len 12 does not divide into 2 x parallel.context 8 = 16 chunks; nearest "
             "valid seq_len: 16");
  EXPECT_HAS(error_of(kBase,
                      {"parallel.context=2", "parallel.tensor=4", "parallel.sequence_parallel=true",
                       "model.seq_len=36"},
                      8),
             "model.seq_len 36 does not divide into parallel.context 2 x lcm(2, parallel.tensor "
             "4) = 8 (2 x context chunks, each rank's pair split over the tensor group); nearest "
             "valid seq_len: 32 or 40");
  EXPECT_HAS(error_of(kBase, {"parallel.context=8", "parallel.context_comm=a2a"}, 8),
             "parallel.context_comm a2a gives each rank n_head / parallel.tensor / "
             "parallel.context heads, but model.n_head 4 / tensor 1 = 4 heads do not divide by "
             "parallel.context 8; valid context sizes for a2a: 1, 2, 4 (or context_comm p2p / "
             "all_gather, which split no heads)");
  EXPECT_HAS(error_of(kBase, {"parallel.context=2", "parallel.context_comm=ring"}, 2),
             "parallel.context_comm: unknown value \"ring\" (expected one of p2p, all_gather, "
             "a2a)");
  EXPECT_HAS(
      error_of(kBase, {"model.moe.num_experts=8", "parallel.context=2", "parallel.expert=8"}, 4),
      "parallel.expert 8 does not divide the data-parallel x context-parallel size 2 x 2 "
      "= 4");
  EXPECT_EQ(parse_config(kBase, "cfg.json",
                         {"model.moe.num_experts=4", "parallel.context=2", "parallel.expert=4"}, 4)
                .parallel.expert,
            4);
}

// DeepSpeed's fp16 section as users bring it parses, its keys recorded in
// the resolved config.
TEST(Config, DeepSpeedLossScalingKeys) {
  Config c = parse_config(
      kBase, "cfg.json",
      {"fp16.enabled=true", "fp16.loss_scale_window=100", "fp16.initial_scale_power=12",
       "fp16.hysteresis=3", "fp16.consecutive_hysteresis=true", "fp16.min_loss_scale=0.5"});
  EXPECT_EQ(c.precision, DType::kF16);
  EXPECT_TRUE(c.resolved["fp16"]["enabled"].get<bool>());
  EXPECT_FALSE(c.resolved["bf16"]["enabled"].get<bool>());
  EXPECT_EQ(c.loss_scaling.loss_scale_window, 100);
  EXPECT_EQ(c.loss_scaling.initial_scale_power, 12);
  EXPECT_EQ(c.loss_scaling.hysteresis, 3);
  EXPECT_TRUE(c.loss_scaling.consecutive_hysteresis);
  EXPECT_EQ(c.loss_scaling.min_loss_scale, 0.5);
  EXPECT_EQ(c.resolved["fp16"]["loss_scale_window"], 100);
  const Config d = parse_config(kBase, "cfg.json", {});
  EXPECT_EQ(d.loss_scaling.loss_scale, 0);
  EXPECT_EQ(d.loss_scaling.initial_scale_power, 16);
  EXPECT_EQ(d.loss_scaling.loss_scale_window, 1000);
  EXPECT_EQ(d.loss_scaling.hysteresis, 2);
  EXPECT_FALSE(d.loss_scaling.consecutive_hysteresis);
  EXPECT_EQ(d.loss_scaling.min_loss_scale, 1);
}

// The scale against a sequence worked out by hand from the rules (window 3,
// hysteresis 2, start 2^4 = 16, floor 2).
// docs/config.md's key table is the config table, row for row: a key added,
// renamed or re-defaulted in one and not the other fails here.
TEST(ConfigTable, IsTheKeyTableOfTheDocs) {
  const std::string doc = read_file(std::string(LOOM_SOURCE_DIR) + "/docs/config.md");
  const std::string head = "| key | type | default | meaning |\n|---|---|---|---|\n";
  const size_t a = doc.find(head);
  ASSERT_NE(a, std::string::npos) << "docs/config.md has no key table";
  const size_t from = a + head.size(), to = doc.find("\n\n", from);
  const std::string rows = doc.substr(from, to - from + 1);
  EXPECT_EQ(rows, config_keys_markdown())
      << "docs/config.md's key table differs from src/loom/train/config_keys.cc: print the "
         "table with `loom config keys` and put it in the docs";
  for (const ConfigKey& k : config_keys()) {
    EXPECT_FALSE(k.doc_type.empty()) << k.path;
    EXPECT_TRUE(k.value) << k.path << " is not written to config.resolved.json";
  }
}

// A default is declared once: where the table has one, an absent key
// resolves to it (the rules that land keys with defaults of their own agree).
TEST(ConfigTable, AbsentKeysResolveToTheTablesDefaults) {
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {},
           {"model.moe.num_experts=4"},
           {"scheduler.type=WarmupCosineLR", "scheduler.params.warmup_num_steps=10"}}) {
    const Config c = parse_config(kBase, "cfg.json", extra);
    int checked = 0;
    for (const ConfigKey& k : config_keys()) {
      if (k.fallback.is_null() || (k.shown && !k.shown(c))) continue;
      if (std::find_if(extra.begin(), extra.end(), [&](const std::string& e) {
            return e.rfind(k.path + "=", 0) == 0;
          }) != extra.end())
        continue;
      // The keys the base config sets.
      const nlohmann::json base = nlohmann::json::parse(kBase);
      const nlohmann::json* node = &base;
      for (size_t at = 0, dot = 0; node && dot != std::string::npos; at = dot + 1) {
        dot = k.path.find('.', at);
        const std::string part = k.path.substr(at, dot == std::string::npos ? dot : dot - at);
        node = node->contains(part) ? &(*node)[part] : nullptr;
      }
      if (node) continue;
      EXPECT_EQ(k.value(c), k.fallback) << k.path;
      ++checked;
    }
    EXPECT_GT(checked, 60);
  }
}

TEST(ConfigTable, CommKeysAloneFromTheSameTable) {
  const CommOptions o = comm_options_from({"comm.timeout_s=30", "comm.allreduce=ring"});
  EXPECT_EQ(o.timeout_s, 30);
  EXPECT_EQ(o.allreduce, "ring");
  EXPECT_EQ(o.placement, "topology");  // the table's default
  EXPECT_HAS(test::error_of([] { comm_options_from({"comm.timeout_s=-1"}); }),
             "comm.timeout_s: -1 is out of range (must be > 0");
  EXPECT_HAS(test::error_of([] { comm_options_from({"comm.allreduce=tree"}); }),
             "comm.allreduce: unknown value \"tree\" (expected one of mpi, ring, rhd, "
             "hierarchical, auto)");
  EXPECT_HAS(test::error_of([] { comm_options_from({"comm.timout_s=3"}); }),
             "unknown key 'comm.timout_s' (did you mean 'comm.timeout_s'?)");
  EXPECT_HAS(test::error_of([] { comm_options_from({"model.n_layer=3"}); }),
             "--set model.n_layer=3: only comm.* keys apply here");
}

TEST(LossScaler, FollowsHysteresisAndWindowByHand) {
  LossScaleConfig c;
  c.initial_scale_power = 4;
  c.loss_scale_window = 3;
  c.hysteresis = 2;
  c.min_loss_scale = 2;
  LossScaler s(c);
  EXPECT_EQ(s.scale(), 16);
  // iter: overflow? -> scale after
  //  0 clean: (0 - -1) % 3 = 1        16
  //  1 clean: 2 % 3                   16
  //  2 clean: 3 % 3 = 0 -> double     32 (tolerance refilled to 2)
  //  3 overflow: tolerance 2 -> 1     32
  //  4 overflow: tolerance used: halve 16
  //  5 overflow: tolerance still 1: halve 8
  //  6 clean: (6 - 5) % 3 = 1         8
  //  7 clean: 2                       8
  //  8 clean: 3 % 3 = 0 -> double     16 (tolerance refilled to 2)
  //  9 overflow: 2 -> 1               16
  // 10 overflow: halve                8
  // 11 overflow: halve                4
  // 12 overflow: halve                2 (the floor)
  // 13 overflow at the floor: refused (update returns false), stays 2
  const bool overflow[] = {false, false, false, true, true, true, false,
                           false, false, true,  true, true, true, true};
  const double want[] = {16, 16, 32, 32, 16, 8, 8, 8, 16, 16, 8, 4, 2, 2};
  for (int i = 0; i < 14; ++i) {
    const bool ok = s.update(overflow[i]);
    EXPECT_EQ(ok, i != 13) << "iteration " << i;
    EXPECT_EQ(s.scale(), want[i]) << "iteration " << i;
  }
  // consecutive_hysteresis: every clean step refills the tolerance, so
  // overflows separated by a clean step never halve.
  c.consecutive_hysteresis = true;
  LossScaler t(c);
  for (int i = 0; i < 6; ++i) t.update(i % 2 == 0);
  EXPECT_EQ(t.scale(), 16);
  // A static scale never moves.
  c.loss_scale = 128;
  LossScaler u(c);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(u.update(i % 3 == 0));
  EXPECT_EQ(u.scale(), 128);
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
