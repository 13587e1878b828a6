// Model-level checks on a tiny GPT: the whole backward against finite
// differences in double, f32 against f64, parameter naming and initialisation,
// and that a layout change (micro-batching) leaves the training unchanged.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/model/gpt_stage.h"
#include "loom/optim/adamw.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

GptConfig tiny(float dropout) {
  GptConfig c;
  c.n_layer = 2;
  c.n_embd = 16;
  c.n_head = 2;
  c.vocab_size = 50;  // padded to 128
  c.seq_len = 8;
  c.dropout = dropout;
  return c;
}

using test::tokens;

TEST(Gpt, ParameterNamesAndShapesFollowHuggingFaceGpt2) {
  GptStage<float> m(tiny(0));
  std::vector<std::string> names;
  for (const Param& p : m.layout().params()) names.push_back(p.name);
  ASSERT_EQ(names.size(), 2u + 12u * 2u + 2u);
  EXPECT_EQ(names[0], "transformer.wte.weight");
  EXPECT_EQ(names[1], "transformer.wpe.weight");
  EXPECT_EQ(names[2], "transformer.h.0.ln_1.weight");
  EXPECT_EQ(names[4], "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(names[13], "transformer.h.0.mlp.c_proj.bias");
  EXPECT_EQ(names.back(), "transformer.ln_f.bias");
  // Conv1D stores (in, out).
  EXPECT_EQ(m.layout().find("transformer.h.1.attn.c_attn.weight").shape, Shape({16, 48}));
  EXPECT_EQ(m.layout().find("transformer.h.1.mlp.c_fc.weight").shape, Shape({16, 64}));
  EXPECT_EQ(m.layout().find("transformer.h.1.mlp.c_proj.weight").shape, Shape({64, 16}));
  EXPECT_EQ(m.layout().find("transformer.wte.weight").shape, Shape({128, 16}));
  EXPECT_EQ(m.layout().find("transformer.wpe.weight").shape, Shape({8, 16}));
}

TEST(Gpt, InitIsKeyedOnSeedNameAndIndex) {
  GptStage<float> m(tiny(0));
  m.init(99);
  const Param& fc = m.layout().find("transformer.h.1.mlp.c_fc.weight");
  NormalStream s(99, fc.name);
  for (int64_t i : {0, 1, 7, 500, 1023}) EXPECT_EQ(m.param(fc)[i], s.at(i) * 0.02f);
  const Param& proj = m.layout().find("transformer.h.0.attn.c_proj.weight");
  NormalStream sp(99, proj.name);
  EXPECT_FLOAT_EQ(m.param(proj)[3], sp.at(3) * 0.02f / 2.0f);  // 0.02 / sqrt(2 n_layer)
  EXPECT_EQ(m.param(m.layout().find("transformer.ln_f.weight"))[5], 1.0f);
  EXPECT_EQ(m.param(m.layout().find("transformer.h.0.attn.c_attn.bias"))[5], 0.0f);
  const Param& wte = m.layout().find("transformer.wte.weight");
  for (int64_t i = 50 * 16; i < 128 * 16; ++i) ASSERT_EQ(m.param(wte)[i], 0.0f);  // padding rows
}

TEST(Gpt, BackwardMatchesFiniteDifferencesWithDropout) {
  GptStage<double> m(tiny(0.1f));
  m.init(5);
  const int64_t B = 2, T = 8;
  auto in = tokens(B * T, 50, 1), tg = tokens(B * T, 50, 2);
  auto acts = m.make_activations(B, T);
  StepContext ctx{7, 3, 10, true};
  m.zero_grads();
  m.forward(acts, in.data(), nullptr, tg.data(), ctx);
  m.backward(acts, 1.0);
  std::vector<double> analytic(m.grads(), m.grads() + m.num_params());
  const double h = 1e-5;
  int probes = 0;
  for (const Param& p : m.layout().params()) {
    std::mt19937 gen(static_cast<uint32_t>(p.offset));
    int64_t limit = p.name == "transformer.wte.weight" ? 50 * 16 : p.numel;
    for (int k = 0; k < 6; ++k) {
      int64_t i = static_cast<int64_t>(gen() % static_cast<uint32_t>(limit));
      double* x = m.param(p) + i;
      double saved = *x;
      *x = saved + h;
      double lp = m.forward(acts, in.data(), nullptr, tg.data(), ctx);
      *x = saved - h;
      double lm = m.forward(acts, in.data(), nullptr, tg.data(), ctx);
      *x = saved;
      double fd = (lp - lm) / (2 * h);
      ASSERT_NEAR(analytic[p.offset + i], fd, 1e-7 + 1e-5 * std::abs(fd))
          << p.name << "[" << i << "]";
      probes++;
    }
  }
  EXPECT_EQ(probes, 6 * 28);
  // The padding rows of wte never receive gradient.
  const Param& wte = m.layout().find("transformer.wte.weight");
  for (int64_t i = 50 * 16; i < 128 * 16; ++i) ASSERT_EQ(analytic[wte.offset + i], 0.0);
}

TEST(Gpt, Float32AgreesWithFloat64) {
  GptStage<float> f(tiny(0.1f));
  GptStage<double> d(tiny(0.1f));
  f.init(3);
  d.init(3);
  const int64_t B = 3, T = 8;
  auto in = tokens(B * T, 50, 4), tg = tokens(B * T, 50, 5);
  auto af = f.make_activations(B, T);
  auto ad = d.make_activations(B, T);
  StepContext ctx{1, 0, 0, true};
  f.zero_grads();
  d.zero_grads();
  double lf = f.forward(af, in.data(), nullptr, tg.data(), ctx);
  double ld = d.forward(ad, in.data(), nullptr, tg.data(), ctx);
  EXPECT_NEAR(lf, ld, 1e-5 * ld);
  f.backward(af, 1.0);
  d.backward(ad, 1.0);
  for (int64_t i = 0; i < f.num_params(); ++i)
    ASSERT_NEAR(f.grads()[i], d.grads()[i], 1e-5 + 1e-3 * std::abs(d.grads()[i])) << i;
}

TEST(Gpt, KvCacheDecodingMatchesTheFullForward) {
  // Dense, and with a mixture of experts in block 1 (no dropping: decoding
  // routes each token alone).
  GptConfig moe = tiny(0.1f);
  moe.moe_experts = 4, moe.moe_top_k = 2, moe.moe_every = 2;
  for (const GptConfig& c : {tiny(0.1f), moe}) {
    GptStage<float> m(c);  // dropout is off outside training
    m.init(4);
    const int64_t T = 8;
    auto in = tokens(T, 50, 6);
    auto acts = m.make_activations(1, T);
    m.forward(acts, in.data(), nullptr, nullptr, StepContext{1, 0, 0, false});
    KvCache<float> cache = m.make_kv_cache();
    const int64_t Vp = m.config().padded_vocab();
    for (int64_t t = 0; t < T; ++t) {
      const float* logits = m.decode_step(cache, in[t]);
      for (int64_t v = 0; v < 50; ++v)
        ASSERT_NEAR(logits[v], acts.logits[t * Vp + v], 1e-5) << "position " << t << " token " << v;
    }
    EXPECT_EQ(cache.len, T);
    EXPECT_THROW(m.decode_step(cache, 1), Error);  // full
  }
}

// A mixture-of-experts model's whole backward against finite differences
// (dropout on, capacity dropping, both balancing losses).
TEST(Gpt, MoeBackwardMatchesFiniteDifferences) {
  GptConfig c = tiny(0.1f);
  c.moe_experts = 4, c.moe_top_k = 2, c.moe_every = 1, c.moe_capacity_factor = 1.0;
  c.moe_aux_loss_coef = 0.1, c.moe_z_loss_coef = 0.01;
  GptStage<double> m(c);
  m.init(3);
  const int64_t B = 2, T = 8;
  auto in = tokens(B * T, 50, 1), tg = tokens(B * T, 50, 2);
  auto acts = m.make_activations(B, T);
  const StepContext ctx{5, 3, 0, true};
  m.zero_grads();
  m.forward(acts, in.data(), nullptr, tg.data(), ctx);
  m.backward(acts, 1.0);
  m.take_moe_stats();  // each objective below reads its own forward's
  // The objective backward differentiates: the loss plus the weighted
  // balancing losses of every MoE layer, recomputed from the layer inputs.
  const Param& p = m.layout().find("transformer.h.1.mlp.router.weight");
  const Param& q = m.layout().find("transformer.h.0.mlp.experts.2.c_fc.weight");
  for (const Param* x : {&p, &q})
    for (int64_t i = 0; i < x->numel; i += 7) {
      double* v = m.param(*x) + i;
      const double keep = *v, eps = 1e-5;
      auto objective = [&] {
        const double loss = m.forward(acts, in.data(), nullptr, tg.data(), ctx);
        double extra = 0;
        for (const auto& [layer, st] : m.take_moe_stats())
          extra += c.moe_aux_loss_coef * st.aux + c.moe_z_loss_coef * st.z;
        return loss + extra;
      };
      *v = keep + eps;
      const double up = objective();
      *v = keep - eps;
      const double down = objective();
      *v = keep;
      const double want = (up - down) / (2 * eps);
      EXPECT_NEAR(m.grads()[x->offset + i], want, 1e-6 + 1e-4 * std::abs(want))
          << x->name << " " << i;
    }
}

// Hash and tag routers: fixed gates, so the loss's gradient reaches the
// experts through the dispatched rows alone; no router parameter exists.
TEST(Gpt, FixedRoutersBackwardMatchesFiniteDifferences) {
  for (int router : {1, 2}) {
    GptConfig c = tiny(0.1f);
    c.moe_experts = 4, c.moe_top_k = 2, c.moe_every = 1, c.moe_capacity_factor = 1.0;
    c.moe_aux_loss_coef = 0, c.moe_router = router, c.moe_tag_tokens = {3, 9};
    GptStage<double> m(c);
    EXPECT_EQ(m.layout().find_or_null("transformer.h.0.mlp.router.weight"), nullptr);
    m.init(3);
    const int64_t B = 2, T = 8;
    auto in = tokens(B * T, 50, 1), tg = tokens(B * T, 50, 2);
    in[2] = 9, in[11] = 3;  // a tag in each sample
    auto acts = m.make_activations(B, T);
    const StepContext ctx{5, 3, 0, true};
    m.zero_grads();
    m.forward(acts, in.data(), nullptr, tg.data(), ctx);
    m.backward(acts, 1.0);
    const auto stats = m.take_moe_stats();
    ASSERT_FALSE(stats.empty());
    EXPECT_GT(stats.front().second.dropped, 0) << "capacity 1.0 drops some";
    const Param& q = m.layout().find("transformer.h.1.mlp.experts.1.c_proj.weight");
    const Param& w = m.layout().find("transformer.h.0.attn.c_attn.weight");
    for (const Param* x : {&q, &w})
      for (int64_t i = 0; i < x->numel; i += 11) {
        double* v = m.param(*x) + i;
        const double keep = *v, eps = 1e-5;
        *v = keep + eps;
        const double up = m.forward(acts, in.data(), nullptr, tg.data(), ctx);
        *v = keep - eps;
        const double down = m.forward(acts, in.data(), nullptr, tg.data(), ctx);
        *v = keep;
        const double want = (up - down) / (2 * eps);
        EXPECT_NEAR(m.grads()[x->offset + i], want, 1e-6 + 1e-4 * std::abs(want))
            << (router == 1 ? "hash " : "tag ") << x->name << " " << i;
      }
  }
}

TEST(Gpt, OverfitsAFixedBatch) {
  GptStage<float> m(tiny(0));
  m.init(1);
  AdamW opt(m.layout(), OptimizerConfig{"AdamW", 1e-2, 0.9, 0.99, 1e-8, 0.0});
  const int64_t B = 4, T = 8;
  auto in = tokens(B * T, 50, 8), tg = tokens(B * T, 50, 9);
  auto acts = m.make_activations(B, T);
  double first = 0, last = 0;
  for (int step = 1; step <= 150; ++step) {
    m.zero_grads();
    last = m.forward(acts, in.data(), nullptr, tg.data(), StepContext{1, 0, 0, true});
    if (step == 1) first = last;
    m.backward(acts, 1.0);
    opt.step(m.params(), m.grads(), 1e-2, step);
  }
  EXPECT_NEAR(first, std::log(50.0), 0.3);
  EXPECT_LT(last, 0.1 * first);
}

Config tiny_run(const std::string& batch) {
  std::string text = R"({
    )" + batch + R"(,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2}},
    "model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16, "dropout": 0.1},
    "data": {"synthetic": true},
    "train": {"steps": 4, "seed": 11},
    "log": {"peak_gflops": 100}
  })";
  return parse_config(text, "test", {});
}

TEST(Trainer, MicroBatchingDoesNotChangeTraining) {
  // Samples and dropout masks are keyed on the global sample index, so 1 x 8,
  // 2 x 4 and 8 x 1 micro-batches train the same model up to summation order.
  RunOptions quiet;
  quiet.quiet = true;
  std::vector<std::vector<double>> losses;
  std::vector<std::vector<float>> params;
  for (const char* batch :
       {R"("train_batch_size": 8, "train_micro_batch_size_per_gpu": 8)",
        R"("train_batch_size": 8, "gradient_accumulation_steps": 2)",
        R"("train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8)"}) {
    Trainer t(tiny_run(batch), quiet, ThreadConfig{});
    std::vector<double> l;
    for (int s = 0; s < 4; ++s) l.push_back(t.train_step().loss);
    losses.push_back(l);
    params.emplace_back(t.model().params(), t.model().params() + t.model().num_params());
  }
  for (size_t k = 1; k < losses.size(); ++k) {
    for (int s = 0; s < 4; ++s) EXPECT_NEAR(losses[k][s], losses[0][s], 1e-5 * losses[0][s]);
    double maxdiff = 0;
    for (size_t i = 0; i < params[0].size(); ++i)
      maxdiff = std::max(maxdiff, double(std::abs(params[k][i] - params[0][i])));
    EXPECT_LT(maxdiff, 1e-5);
  }
}

TEST(Trainer, ZeroStagesInOneProcessTrainLikeStageZero) {
  // Without a group every stage keeps one shard (the whole model) but takes
  // its own code path: unit gradient buffers, gathers, the unit schedule.
  RunOptions quiet;
  quiet.quiet = true;
  std::vector<std::vector<double>> losses;
  std::vector<std::vector<float>> params;
  for (int stage : {0, 1, 2, 3}) {
    Config c = tiny_run(R"("train_batch_size": 8, "gradient_accumulation_steps": 2)");
    c.zero.stage = stage;
    c.zero.persistence_threshold = 0;
    Trainer t(std::move(c), quiet, ThreadConfig{});
    std::vector<double> l;
    for (int s = 0; s < 4; ++s) l.push_back(t.train_step().loss);
    l.push_back(t.evaluate());  // forward only: a plan without backward
    losses.push_back(l);
    params.push_back(t.gather_params());
  }
  for (size_t k = 1; k < losses.size(); ++k) {
    for (size_t s = 0; s < losses[0].size(); ++s)
      EXPECT_NEAR(losses[k][s], losses[0][s], 1e-6 * losses[0][s]) << "stage " << k;
    ASSERT_EQ(params[k].size(), params[0].size());
    double maxdiff = 0;
    for (size_t i = 0; i < params[0].size(); ++i)
      maxdiff = std::max(maxdiff, double(std::abs(params[k][i] - params[0][i])));
    EXPECT_LT(maxdiff, 1e-6) << "stage " << k;
  }
}

TEST(Trainer, RunsAreBitwiseReproducible) {
  RunOptions quiet;
  quiet.quiet = true;
  auto run = [&] {
    Trainer t(tiny_run(R"("train_batch_size": 4)"), quiet, ThreadConfig{});
    std::vector<double> l;
    for (int s = 0; s < 3; ++s) l.push_back(t.train_step().loss);
    return l;
  };
  EXPECT_EQ(run(), run());
}

}  // namespace
}  // namespace loom
