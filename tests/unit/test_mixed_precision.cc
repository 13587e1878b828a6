// 16-bit training in one process: the model state's bytes, loss tracking
// against f32, fp16's dynamic loss scale step by step, the errors that stop
// a run, and checkpoints across precisions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "loom/checkpoint/sharded.h"
#include "loom/core/memory.h"
#include "loom/io/safetensors.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/train/checkpointer.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

const char* kRun = R"({
  "train_batch_size": 8, "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2}},
  "model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16, "dropout": 0.1},
  "data": {"synthetic": true},
  "train": {"steps": 12, "seed": 5},
  "log": {"peak_gflops": 100}
})";

RunOptions quiet() {
  RunOptions o;
  o.quiet = true;
  return o;
}

std::vector<StepResult> run(const std::vector<std::string>& overrides, RunOptions o = quiet()) {
  Trainer t(parse_config(kRun, "test", overrides), std::move(o), ThreadConfig{});
  return t.run();
}

// Sets an environment variable for one scope.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const std::string& v) : name(n) { ::setenv(n, v.c_str(), 1); }
  ~ScopedEnv() { ::unsetenv(name); }
};

// Parameters 2 bytes, gradients 2, masters and moments 12: the ZeRO paper's
// 2 + 2 + K with K = 12, against 4 + 4 + 8 in f32. The f32 copies the layers
// read exist only while a unit is in use (the category comm).
TEST(MixedPrecision, ModelStateIsSixteenBytesPerParameter) {
  for (const char* t : {"f32", "bf16", "fp16"}) {
    std::vector<std::string> o = {"train.steps=3"};
    if (std::string(t) != "f32") o.push_back(std::string(t) + ".enabled=true");
    for (int stage : {0, 3}) {
      o.push_back("zero_optimization.stage=" + std::to_string(stage));
      Trainer tr(parse_config(kRun, "test", o), quiet(), ThreadConfig{});
      tr.train_step();
      const size_t n = static_cast<size_t>(tr.engine().stage().num_params());
      const MemStats m = memory_tracker().stats();
      const bool half = std::string(t) != "f32";
      auto cur = [&](MemCategory c) { return m.current[static_cast<int>(c)]; };
      // bf16 GEMMs reading the 16-bit weights keep them in the matmul's
      // blocked layout too, below stage 3 (a layout for each direction).
      const size_t packs = tr.zero().weight_pack_bytes();
      if (tr.config().kernels.gemm16 && std::string(t) == "bf16" && stage < 3)
        EXPECT_GE(packs, 2 * n) << "stage " << stage;
      else
        EXPECT_EQ(packs, 0u) << t << " stage " << stage;
      EXPECT_EQ(cur(MemCategory::kParams), (half ? 2 : 4) * n + packs) << t << " stage " << stage;
      EXPECT_EQ(cur(MemCategory::kGrads), (half ? 2 : 4) * n) << t << " stage " << stage;
      EXPECT_EQ(cur(MemCategory::kOptimizer), (half ? 12 : 8) * n) << t << " stage " << stage;
      o.pop_back();
    }
  }
}

// Every ZeRO stage in one process holds one shard (the whole model) but
// takes its own path (the f32 unit buffers added into the 16-bit gradients
// at stages 0-1, the reduction's path at 2-3, gathers at 3): the same
// arithmetic, so the same run bit for bit.
TEST(MixedPrecision, EveryZeroStageInOneProcessTrainsTheSame) {
  for (const char* t : {"bf16", "fp16"}) {
    std::vector<std::vector<double>> losses;
    for (int stage : {0, 1, 2, 3}) {
      std::vector<double> l;
      for (const StepResult& r : run({std::string(t) + ".enabled=true",
                                      "zero_optimization.stage=" + std::to_string(stage),
                                      "zero_optimization.stage3_param_persistence_threshold=0"}))
        l.push_back(r.loss);
      losses.push_back(l);
    }
    for (int stage = 1; stage < 4; ++stage)
      EXPECT_EQ(losses[static_cast<size_t>(stage)], losses[0]) << t << " stage " << stage;
  }
}

// The 16-bit runs follow the f32 run: their weights are the f32 masters
// rounded (a relative error of 2^-9 in bf16, 2^-12 in fp16), which moves
// the loss of this small model on random tokens by 2e-5 (bf16) and 3e-6
// (fp16) relative at most (measured). The bound leaves a factor of 25-50;
// the demo data's 300-step comparison is in docs/performance.md.
TEST(MixedPrecision, Bf16AndFp16TrackTheF32Run) {
  const std::vector<StepResult> f32 = run({"train.steps=30"});
  for (const char* t : {"bf16", "fp16"}) {
    const std::vector<StepResult> half = run({"train.steps=30", std::string(t) + ".enabled=true"});
    ASSERT_EQ(half.size(), f32.size());
    double worst = 0;
    for (size_t s = 0; s < f32.size(); ++s)
      worst = std::max(worst, std::abs(half[s].loss - f32[s].loss) / f32[s].loss);
    EXPECT_LT(worst, std::string(t) == "bf16" ? 5e-4 : 1e-4) << t;
    EXPECT_EQ(half.back().skipped_steps, 0) << t;
    std::printf("[ precision ] %s: loss %.5f -> %.5f, largest relative difference from f32 %.1e\n",
                t, half.front().loss, half.back().loss, worst);
  }
}

// kernels.gemm_inputs: 16bit rounds every GEMM's activations too (the
// weights are 16-bit values already): the run stays within a fraction of a
// percent of the one with f32 GEMM inputs (and differs from it: the inputs
// were rounded). The setting belongs to the run's backend: a run beside it
// (the default backend) keeps f32 inputs.
TEST(MixedPrecision, SixteenBitGemmInputsTrainLikeF32Inputs) {
  // (bf16 16bit needs a bf16 matmul: an error on a CPU without one.)
  const bool bf16_gemms = cpu::gemm_16_uses_bf16_matmul(DType::kBF16);
  for (const char* t : {"bf16", "fp16"}) {
    if (std::string(t) == "bf16" && !bf16_gemms) continue;
    const std::string on = std::string(t) + ".enabled=true";
    const std::vector<StepResult> f32_in = run({on, "kernels.gemm_inputs=f32"});
    const std::vector<StepResult> half_in = run({on, "kernels.gemm_inputs=16bit"});
    double worst = 0;
    for (size_t s = 0; s < f32_in.size(); ++s)
      worst = std::max(worst, std::abs(half_in[s].loss - f32_in[s].loss) / f32_in[s].loss);
    EXPECT_GT(worst, 0) << t << ": the inputs were not rounded";
    // Measured: 1.6e-5 (bf16), 2.3e-6 (fp16).
    EXPECT_LT(worst, std::string(t) == "bf16" ? 2e-4 : 5e-5) << t;
    std::printf("[ precision ] %s with 16-bit GEMM inputs: largest relative loss difference %.1e\n",
                t, worst);
  }
  if (bf16_gemms) {
    Trainer tr(parse_config(kRun, "test", {"bf16.enabled=true", "kernels.gemm_inputs=16bit"}),
               quiet(), ThreadConfig{});
    EXPECT_EQ(tr.gemm_inputs(), DType::kBF16);
    EXPECT_EQ(&tr.engine().stage().backend(), &tr.backend()) << "the stage computes elsewhere";
    const auto* other = dynamic_cast<const CpuBackend<float>*>(&default_backend<float>());
    ASSERT_NE(other, nullptr);
    EXPECT_EQ(other->gemm_config().inputs, DType::kF32);
  }
}

// With 16-bit GEMM inputs the layers read a unit's matrices in 16 bits
// where the engine holds them (the embeddings' lookups widen the rows
// they read), and only the unit's other parameters are widened to f32:
// the GEMMs see the same values as through a whole f32 copy rounded
// again, so the run is bit for bit the one with the copy, at every ZeRO
// stage; the copy's bytes leave the `comm` category's peak; and a layer
// reading a matrix as f32 while so bound is stopped naming it.
TEST(MixedPrecision, SixteenBitGemmsReadTheSixteenBitWeightsWithoutAnF32Copy) {
  for (const char* t : {"bf16", "fp16"})
    for (int stage : {0, 3}) {
      if (std::string(t) == "bf16" && !cpu::gemm_16_uses_bf16_matmul(DType::kBF16)) continue;
      const std::vector<std::string> o = {std::string(t) + ".enabled=true",
                                          "kernels.gemm_inputs=16bit", "train.steps=4",
                                          "zero_optimization.stage=" + std::to_string(stage),
                                          "zero_optimization.stage3_param_persistence_threshold=0"};
      auto train = [&](bool weights16) {
        Config c = parse_config(kRun, "test", o);
        EXPECT_TRUE(c.zero.weights16);
        c.zero.weights16 = weights16;
        Trainer tr(c, quiet(), ThreadConfig{});
        memory_tracker().reset_peaks();
        std::vector<double> losses, norms;
        for (const StepResult& r : tr.run()) losses.push_back(r.loss), norms.push_back(r.grad_norm);
        const size_t comm = memory_tracker().stats().peak[static_cast<int>(MemCategory::kComm)];
        return std::make_tuple(losses, norms, comm);
      };
      const auto [l16, s16, comm16] = train(true);
      const auto [l32, s32, comm32] = train(false);
      const std::string what = std::string(t) + " stage " + std::to_string(stage);
      EXPECT_EQ(l16, l32) << what;
      EXPECT_EQ(s16, s32) << what;
      // The largest unit, the embeddings (wte 64 x 32 and wpe 16 x 32), is
      // no longer widened: its 2560 f32 elements leave the peak.
      EXPECT_LE(comm16 + 2560 * 4, comm32) << what;
      std::printf(
          "[ precision ] %s, 16-bit GEMMs: comm peak %zu bytes reading 16-bit weights, "
          "%zu with an f32 copy\n",
          what.c_str(), comm16, comm32);
    }
  // A matrix read as f32 while its unit is bound in 16 bits.
  ParamLayout layout;
  layout.begin_unit("u");
  const ParamId w = layout.add("m.weight", {4, 8}, true, ParamInit{});
  const ParamId b = layout.add("m.bias", {8}, false, ParamInit{});
  ParamStore<float> ps;
  ps.build(std::move(layout), StoreOptions{1, false, false});
  std::vector<uint16_t> h(48, 0x3f80);  // bf16 1.0
  std::vector<float> widened(16, 2.0f);
  ps.bind_params16(0, h.data(), widened.data(), DType::kBF16);
  EXPECT_EQ(ps.weight(w).w16, h.data());
  EXPECT_EQ(ps.weight(w)[3], 1.0f);
  EXPECT_EQ(ps.param(b), widened.data() + ps.layout()[b].widened);
  EXPECT_HAS(test::error_of([&] { ps.param(w); }),
             "'m.weight' is held in 16 bits alone while 16-bit GEMMs read it");
}

// Overflows forced at steps 2, 3, 4 and 9 (a NaN in one gradient), hysteresis
// 2, window 3, from 2^10: by hand (the scale a step runs with; the update
// after it):
//   step  1  1024  clean (1 clean step since the start)
//   step  2  1024  overflow: the first is tolerated (hysteresis 2 -> 1)
//   step  3  1024  overflow: halved to 512
//   step  4   512  overflow: halved to 256
//   steps 5-7 256  clean; the third clean step since the overflow doubles it
//                  and refills the hysteresis
//   step  8   512  clean
//   step  9   512  overflow: tolerated (hysteresis 2 -> 1)
//   steps 10-12 512 clean; the third doubles it
//   step 13  1024
TEST(MixedPrecision, Fp16LossScaleFollowsTheHandComputedSequence) {
  ScopedEnv inject("LOOM_TEST_NONFINITE", "2,3,4,9:transformer.h.1.mlp.c_fc.weight");
  const std::vector<StepResult> r =
      run({"fp16.enabled=true", "fp16.initial_scale_power=10", "fp16.hysteresis=2",
           "fp16.loss_scale_window=3", "train.steps=13"});
  const std::vector<double> scale = {1024, 1024, 1024, 512, 256, 256, 256,
                                     512,  512,  512,  512, 512, 1024};
  const std::vector<int64_t> skipped = {0, 1, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4};
  ASSERT_EQ(r.size(), scale.size());
  for (size_t s = 0; s < r.size(); ++s) {
    EXPECT_EQ(r[s].loss_scale, scale[s]) << "step " << s + 1;
    EXPECT_EQ(r[s].skipped_steps, skipped[s]) << "step " << s + 1;
  }
  // A static scale never moves; overflows only skip.
  const std::vector<StepResult> fixed =
      run({"fp16.enabled=true", "fp16.loss_scale=128", "train.steps=5"});
  for (const StepResult& s : fixed) EXPECT_EQ(s.loss_scale, 128.0);
}

TEST(MixedPrecision, OverflowAtTheMinimumScaleStopsNamingTheParameter) {
  // From 512 with min 256 and no hysteresis: step 1 halves to 256, step 2
  // overflows at the floor.
  ScopedEnv inject("LOOM_TEST_NONFINITE", "1,2:transformer.h.1.attn.c_proj.weight");
  EXPECT_HAS(test::error_of([] {
               run({"fp16.enabled=true", "fp16.initial_scale_power=9", "fp16.min_loss_scale=256",
                    "fp16.hysteresis=1"});
             }),
             "step 2: fp16 gradients overflow at the minimum loss scale 256 "
             "(fp16.min_loss_scale), first in 'transformer.h.1.attn.c_proj.weight'");
}

TEST(MixedPrecision, Bf16NonFiniteGradientStopsOrSkipsNamingTheParameter) {
  ScopedEnv inject("LOOM_TEST_NONFINITE", "3:transformer.h.0.ln_1.weight");
  EXPECT_HAS(test::error_of([] { run({"bf16.enabled=true"}); }),
             "step 3: non-finite gradient (norm nan) first in 'transformer.h.0.ln_1.weight'");
  const std::vector<StepResult> r = run({"bf16.enabled=true", "train.on_nonfinite=skip"});
  EXPECT_EQ(r[1].skipped_steps, 0);
  EXPECT_EQ(r[2].skipped_steps, 1);
  EXPECT_EQ(r.back().skipped_steps, 1);
}

// Checkpoints hold the f32 masters (as model.safetensors) and the moments:
// a bf16 run resumes bitwise; an f32 run resumes from a bf16 checkpoint and
// a bf16 run from an f32 one.
TEST(MixedPrecision, CheckpointsResumeBitwiseAndAcrossPrecisions) {
  test::TempDir dir;
  auto opts = [&](const std::string& out, const std::string& resume) {
    RunOptions o = quiet();
    o.out_dir = dir.file(out);
    o.resume = resume;
    return o;
  };
  for (const char* t : {"bf16", "fp16"}) {
    const std::string on = std::string(t) + ".enabled=true";
    const std::vector<std::string> base = {on, "train.steps=8", "checkpoint.every=4"};
    const std::vector<StepResult> whole = run(base, opts(std::string(t) + "-whole", ""));
    const std::string ckpt = dir.file(std::string(t) + "-whole") + "/checkpoints/step-00000004";
    const std::vector<StepResult> resumed = run(base, opts(std::string(t) + "-resumed", ckpt));
    ASSERT_EQ(resumed.size(), 4u) << t;
    for (size_t s = 0; s < 4; ++s) {
      EXPECT_EQ(resumed[s].loss, whole[s + 4].loss) << t << " step " << s + 5;
      EXPECT_EQ(resumed[s].loss_scale, whole[s + 4].loss_scale) << t << " step " << s + 5;
    }
    // Into f32 and back: the same weights, so the next loss is close.
    const std::vector<StepResult> as_f32 =
        run({"train.steps=8", "checkpoint.every=4"}, opts(std::string(t) + "-f32", ckpt));
    EXPECT_NEAR(as_f32.front().loss, whole[4].loss, 1e-2 * whole[4].loss) << t;
    const std::string f32_ckpt = dir.file(std::string(t) + "-f32") + "/checkpoints/step-00000008";
    const std::vector<StepResult> back =
        run({on, "train.steps=10"}, opts(std::string(t) + "-back", f32_ckpt));
    ASSERT_EQ(back.size(), 2u) << t;
    EXPECT_NEAR(back.front().loss, as_f32.back().loss, 2e-2 * as_f32.back().loss) << t;
  }
  // Weights stored in 16 bits (a converted file) hold no masters: resuming a
  // 16-bit run from them is refused; starting from them (no moments) is not.
  // (One rank wrote the checkpoint: its file holds every tensor whole,
  // flattened; the manifest has the shapes.)
  const std::string step8 = dir.file("bf16-whole") + "/checkpoints/step-00000008";
  const std::string f32_file = step8 + "/rank-00000.safetensors";
  const std::string bf16_file = dir.file("weights-bf16.safetensors");
  {
    SafetensorsFile in(f32_file);
    const CheckpointReader manifest(step8);
    std::vector<std::vector<uint16_t>> data;
    data.reserve(in.entries().size());
    std::vector<SafetensorsEntry> out;
    for (const SafetensorsEntry& e : in.entries()) {
      if (e.name.starts_with("exp_avg")) continue;
      const size_t n = e.bytes / 4;
      data.emplace_back(n);
      convert(e.data, DType::kF32, data.back().data(), DType::kBF16, n);
      out.push_back({e.name, DType::kBF16, manifest.shape(e.name), data.back().data(), 2 * n});
    }
    write_safetensors(bf16_file, out);
  }
  Trainer tr(parse_config(kRun, "test", {"bf16.enabled=true"}), quiet(), ThreadConfig{});
  EXPECT_HAS(test::error_of([&] {
               Checkpointer::load(tr.engine(), CheckpointReader::of_file(bf16_file), true);
             }),
             "weights-bf16.safetensors: 'transformer.wte.weight' is stored in bf16, not f32: a "
             "bf16 run resumes from f32 master weights, which this checkpoint does not hold");
  EXPECT_EQ(test::error_of([&] {
              Checkpointer::load(tr.engine(), CheckpointReader::of_file(bf16_file), false);
            }),
            "(no error)");
}

}  // namespace
}  // namespace loom
