// device: cuda in one process. On a build without CUDA and on a machine
// without a GPU: the refusals, by their messages. With a GPU: a run on the
// GPU trains like the same run on the CPU (f32, losses within 1e-4
// relative over 20 steps, dropout on: the masks are the CPU's), bf16 runs,
// a checkpoint written on the GPU loads on the CPU bit for bit and back,
// and an NCCL group of one rank does every collective. (The operations are
// checked one by one in the backend harness, tests/unit/test_backend_ops.cc.)
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "test_util.h"
#ifdef LOOM_HAVE_CUDA
#include "loom/comm/nccl/nccl_process_group.h"
#include "loom/kernels/cuda/cuda_backend.h"
#endif

namespace loom {
namespace {

const char* kRun = R"({
  "train_batch_size": 8, "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2}},
  "model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 96, "seq_len": 32, "dropout": 0.1},
  "data": {"synthetic": true},
  "train": {"steps": 20, "seed": 11},
  "log": {"peak_gflops": 100}
})";

RunOptions quiet() {
  RunOptions o;
  o.quiet = true;
  return o;
}

[[maybe_unused]] std::vector<StepResult> run(const std::vector<std::string>& overrides,
                                             RunOptions o = quiet()) {
  Trainer t(parse_config(kRun, "test", overrides), std::move(o), ThreadConfig{});
  return t.run();
}

[[maybe_unused]] bool have_gpu() {
#ifdef LOOM_HAVE_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

TEST(Cuda, KeysThatNeedADeviceAreRefusedOnTheCpu) {
  EXPECT_HAS(test::error_of([] { parse_config(kRun, "test", {"comm.backend=nccl"}); }),
             "test: comm.backend nccl needs device: cuda");
  EXPECT_HAS(test::error_of([] { parse_config(kRun, "test", {"kernels.tf32=true"}); }),
             "test: kernels.tf32 applies to device: cuda");
  EXPECT_HAS(test::error_of([] { parse_config(kRun, "test", {"device=tpu"}); }), "device");
}

#ifndef LOOM_HAVE_CUDA
TEST(Cuda, ABuildWithoutCudaRefusesDeviceCuda) {
  EXPECT_HAS(test::error_of([] { parse_config(kRun, "test", {"device=cuda"}); }),
             "test: device: cuda needs loom built with -DLOOM_CUDA=ON");
}
#else
TEST(Cuda, NoGpuIsAClearError) {
  if (have_gpu()) GTEST_SKIP() << "this machine has a GPU";
  const Config c = parse_config(kRun, "test", {"device=cuda"});
  EXPECT_HAS(test::error_of([&] { Trainer t(c, quiet(), ThreadConfig{}); }),
             "device: cuda, but this machine has no CUDA device");
}

TEST(Cuda, TrainsLikeTheCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<StepResult> cpu = run({});
  const std::vector<StepResult> gpu = run({"device=cuda"});
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t i = 0; i < cpu.size(); ++i)
    EXPECT_NEAR(gpu[i].loss, cpu[i].loss, 1e-4 * std::abs(cpu[i].loss)) << "step " << i + 1;
  // bf16 with 16-bit GEMM inputs trains too, near f32.
  const std::vector<StepResult> bf16 =
      run({"device=cuda", "bf16.enabled=true", "kernels.gemm_inputs=16bit"});
  EXPECT_NEAR(bf16.back().loss, cpu.back().loss, 0.05 * cpu.back().loss);
}

TEST(Cuda, CheckpointsMoveBetweenGpuAndCpuBitwise) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  test::TempDir dir;
  RunOptions o = quiet();
  o.out_dir = dir.file("gpu");
  run({"device=cuda", "train.steps=6", "checkpoint.every=3"}, o);
  // The CPU resumes the GPU's step 3 and the GPU resumes it too: the same
  // parameters after the load, bit for bit.
  auto resume = [&](const std::string& out) {
    RunOptions r = quiet();
    r.out_dir = dir.file(out);
    r.resume = dir.file("gpu") + "/checkpoints/step-00000003";
    return r;
  };
  Trainer on_cpu(parse_config(kRun, "test", {"train.steps=6"}), resume("cpu"), ThreadConfig{});
  Trainer on_gpu(parse_config(kRun, "test", {"train.steps=6", "device=cuda"}), resume("gpu2"),
                 ThreadConfig{});
  EXPECT_EQ(on_cpu.gather_params(), on_gpu.gather_params());
}

TEST(Cuda, AnNcclGroupOfOneRankDoesEveryCollective) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  // A one-rank bootstrap group: broadcasts to itself.
  struct Self final : ProcessGroup {
    std::string n = "self";
    int rank() const override { return 0; }
    int size() const override { return 1; }
    const std::string& name() const override { return n; }
    WorkPtr done() {
      auto w = std::make_shared<Work>();
      w->finish(0);
      return w;
    }
    WorkPtr all_reduce(const void*, void*, size_t, DType, ReduceOp) override { return done(); }
    WorkPtr reduce_scatter(const void*, void*, size_t, DType, ReduceOp) override { return done(); }
    WorkPtr all_gather(const void*, void*, size_t, DType) override { return done(); }
    WorkPtr broadcast(void*, size_t, DType, int) override { return done(); }
    WorkPtr all_to_all(const void*, const std::vector<size_t>&, void*, const std::vector<size_t>&,
                       DType) override {
      return done();
    }
    WorkPtr send(const void*, size_t, DType, int, int, const std::string&) override {
      return done();
    }
    WorkPtr recv(void*, size_t, DType, int, int, const std::string&) override { return done(); }
    WorkPtr barrier() override { return done(); }
  } self;
  auto g = NcclProcessGroup::create(self, "dp", cuda_select_device(), 60, nullptr);
  const CudaBackend<float> be;
  Buffer a = be.alloc(sizeof(float) * 8, MemCategory::kComm, true);
  Buffer b = be.alloc(sizeof(float) * 8, MemCategory::kComm, true);
  for (int i = 0; i < 8; ++i) a.as<float>()[i] = float(i);
  g->all_reduce(a.data(), b.data(), 8, DType::kF32, ReduceOp::kSum)->wait();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(b.as<float>()[i], float(i));
  g->all_gather(a.data(), b.data(), 8, DType::kF32)->wait();
  EXPECT_EQ(b.as<float>()[7], 7.0f);
  // A host buffer goes through a device copy and back.
  std::vector<double> h = {1.5, 2.5};
  g->all_reduce(h.data(), h.data(), 2, DType::kF64, ReduceOp::kMax)->wait();
  EXPECT_EQ(h[1], 2.5);
  g->broadcast(a.data(), 8, DType::kF32, 0)->wait();
  g->all_to_all(a.data(), {8}, b.data(), {8}, DType::kF32)->wait();
  EXPECT_EQ(b.as<float>()[3], 3.0f);
  g->barrier()->wait();
}
#endif

}  // namespace
}  // namespace loom
