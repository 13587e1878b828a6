// One verdict for the whole job: a non-finite gradient seen by one rank
// only is skipped by every rank (the norm is agreed over the job, so no rank
// enters a collective the others skip), the fp16 loss scale moves alike,
// and parameters replicated over a tensor-parallel group that diverge are
// named at the check every checkpoint runs.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "mpi_main.h"

namespace loom {
namespace {

using test::runtime;

const char* kConfig = R"({
  "train_batch_size": 8,
  "gradient_clipping": 1.0,
  "model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 128, "seq_len": 16},
  "data": {"synthetic": true},
  "train": {"steps": 5, "seed": 3, "on_nonfinite": "skip"},
  "log": {"peak_gflops": 100}
})";

std::unique_ptr<Trainer> make(const std::vector<std::string>& overrides,
                              std::shared_ptr<ProcessGroup> world, GridShape shape) {
  Config c = parse_config(kConfig, "verdicts", overrides, world->size());
  RunOptions o;
  o.quiet = true;
  o.parallel = make_parallel_context(std::move(world), shape);
  return std::make_unique<Trainer>(std::move(c), o, ThreadConfig{});
}

// A digest of this rank's whole parameter buffer (ZeRO stage 0: every
// data-parallel rank holds it all).
uint64_t digest(Trainer& t) {
  const std::vector<float> p = t.gather_params();
  return name_hash({reinterpret_cast<const char*>(p.data()), p.size() * sizeof(float)});
}

TEST(Verdicts, ANonFiniteGradientOnOneRankIsSkippedByEveryRank) {
  const int n = runtime().world_size();
  CommOptions opt;
  opt.timeout_s = 60;  // a rank left alone in a collective would end the test here
  for (const std::string precision : {"f32", "fp16"}) {
    auto world = runtime().world(opt);
    std::vector<std::string> set = {"parallel.data=" + std::to_string(n)};
    if (precision == "fp16") set.insert(set.end(), {"fp16.enabled=true", "fp16.hysteresis=1"});
    // After the reduction, on rank 1 alone: the ranks' own norms differ.
    if (world->rank() == 1) ::setenv("LOOM_TEST_NONFINITE", "3:transformer.h.1.mlp.c_fc.weight", 1);
    auto t = make(set, world, GridShape{n});
    const std::vector<StepResult> got = t->run();
    ::unsetenv("LOOM_TEST_NONFINITE");
    ASSERT_EQ(got.size(), 5u);
    for (size_t k = 0; k < got.size(); ++k)
      EXPECT_EQ(got[k].skipped_steps, k >= 2 ? 1 : 0) << precision << " step " << k + 1;
    if (precision == "fp16") {
      EXPECT_EQ(got[3].loss_scale, got[2].loss_scale / 2) << "the overflow halves the scale";
    }
    // Every rank took the same decisions: the replicas are still one.
    const uint64_t mine = digest(*t);
    const std::vector<uint64_t> all = all_gather_words(*world, &mine, 1);
    for (int r = 1; r < n; ++r) EXPECT_EQ(all[static_cast<size_t>(r)], all[0]) << precision;
  }
}

TEST(Verdicts, ReplicatedParametersThatDivergeAreNamed) {
  const int n = runtime().world_size();
  CommOptions opt;
  opt.timeout_s = 60;
  auto t = make({"parallel.tensor=2"}, runtime().world(opt), GridShape{n, 2});
  t->train_step();
  t->engine().check_replicas();  // equal after a step
  // One element of a replicated LayerNorm weight, changed on tensor rank 1.
  const std::string name = "transformer.h.0.ln_1.weight";
  const Param& p = t->model().layout().find(name);
  const ZeroEngine::StateRange r =
      t->zero().held(ZeroEngine::State::kParams)[static_cast<size_t>(p.unit)];
  ASSERT_TRUE(r.begin <= p.offset && p.offset < r.end);  // on every rank alike
  if (t->engine().context().tp->rank() == 1) r.data[p.offset - r.begin] += 1e-6f;
  try {
    t->engine().check_replicas();
    ADD_FAILURE() << "the divergence went unnoticed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("replicated parameter '" + name +
                                         "' differs between tensor-parallel ranks 0 and 1"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace loom
