// loom plan: the memory model against the ZeRO paper's table, the FLOP
// count against Narayanan et al.'s, the cluster and layout parsers' errors,
// and the search's pruning and its errors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "loom/core/error.h"
#include "loom/model/gpt_stage.h"
#include "loom/plan/loom_memory.h"
#include "loom/plan/planner.h"
#include "loom/profile/calibrate.h"
#include "test_util.h"

namespace loom::plan {
namespace {

using nlohmann::json;

json selene() {
  return json::parse(R"({"name": "selene-a100", "gpus_per_node": 8,
    "gpu": {"name": "A100", "memory_bytes": 85899345920, "reserved_bytes": 3e9,
            "peak_tflops_16bit": 312, "peak_tflops_32bit": 156, "memory_bandwidth_GBps": 2039,
            "gemm_efficiency": {"max": 0.8, "half_at_gflop": 2}},
    "links": {"node": {"bandwidth_GBps": 300, "latency_us": 5},
              "cluster": {"bandwidth_GBps": 25, "latency_us": 5}}})");
}

ModelShape gpt(int64_t layers, int64_t hidden, int64_t heads) {
  return parse_model(json{{"model",
                           {{"n_layer", layers},
                            {"n_embd", hidden},
                            {"n_head", heads},
                            {"vocab_size", 51200},
                            {"seq_len", 2048}}}},
                     "test");
}

// Rajbhandari et al. 2020, Table 1: per-device memory (GB) of the model
// states for 7.5B, 128B and 1T parameters over 1 to 1024 data-parallel
// devices, K = 12: stages 1, 2 and 3 (P_os, P_os+g, P_os+g+p), as printed.
TEST(Plan, ModelStatesAreTheZeroPapersTable) {
  struct Row {
    int dp;
    double gb[3][3];  // per model size: stage 1, 2, 3
  };
  const double psi[3] = {7.5e9, 128e9, 1e12};
  const Row rows[] = {
      {1, {{120, 120, 120}, {2048, 2048, 2048}, {16000, 16000, 16000}}},
      {4, {{52.5, 41.3, 30}, {896, 704, 512}, {7000, 5500, 4000}}},
      {16, {{35.6, 21.6, 7.5}, {608, 368, 128}, {4750, 2875, 1000}}},
      {64, {{31.4, 16.6, 1.88}, {536, 284, 32}, {4187, 2218, 250}}},
      {256, {{30.4, 15.4, 0.47}, {518, 263, 8}, {4046, 2054, 62.5}}},
      {1024, {{30.1, 15.1, 0.12}, {513, 257, 2}, {4011, 2013, 15.6}}},
  };
  for (const Row& r : rows)
    for (int s = 0; s < 3; ++s) {
      EXPECT_DOUBLE_EQ(model_states(psi[s], "bf16", 0, r.dp).total(), 16 * psi[s]);
      for (int stage = 1; stage <= 3; ++stage) {
        const double gb = model_states(psi[s], "bf16", stage, r.dp).total() / 1e9;
        const double printed = r.gb[s][stage - 1];
        // The table prints three significant figures, two decimals below 1 (rounded, or cut).
        const double unit = std::max(0.01, std::pow(10.0, std::floor(std::log10(printed)) - 2));
        EXPECT_NEAR(gb, printed, unit)
            << psi[s] << " parameters, dp " << r.dp << ", stage " << stage;
      }
    }
  // f32: 4 + 4 + 8 bytes.
  EXPECT_DOUBLE_EQ(model_states(1e9, "f32", 0, 1).total(), 16e9);
  EXPECT_DOUBLE_EQ(model_states(1e9, "f32", 1, 4).optimizer, 2e9);
}

// Narayanan et al. 2021: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs a step with
// full recomputation; 72 B s l h^2 (1 + s/6h + V/12lh) without.
TEST(Plan, StepFlopsAreMegatronsCount) {
  const ModelShape m = gpt(128, 25600, 160);
  EXPECT_NEAR(m.params() / 1e9, 1008, 1);  // the table's 1008B
  const double B = 3072, s = 2048, l = 128, h = 25600, V = 51200;
  EXPECT_NEAR(
      step_flops(m, 3072, true) / (96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))),
      1, 1e-12);
  EXPECT_NEAR(
      step_flops(m, 3072, false) / (72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))),
      1, 1e-12);
}

// An engine that keeps Korthikanti et al.'s 16-bit activations (as
// megatron-2021 does) rather than loom's own records.
TEST(Plan, ActivationsAreKorthikantisCounts) {
  const ClusterSpec c = parse_cluster(selene(), "selene");
  const ModelShape m = gpt(24, 2304, 24);
  Engine k;
  k.executor_memory = false;
  auto estimate = [&](const ModelShape& m, const ClusterSpec& c, int64_t batch, const Layout& l) {
    return plan::estimate(m, c, batch, l, k);
  };
  Layout l;
  l.tp = 8, l.dp = 4, l.micro = 1, l.zero = 0;
  const double s = 2048, b = 1, h = 2304, a = 24, t = 8;
  // No recomputation, no sequence parallelism: sbh(10 + 24/t + 5as/ht) a layer.
  EXPECT_NEAR(estimate(m, c, 4, l).mem.activations,
              24 * s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), 1);
  l.sp = true;  // 34/t + 5as/ht
  EXPECT_NEAR(estimate(m, c, 4, l).mem.activations, 24 * s * b * h * (34 / t + 5 * a * s / (h * t)),
              1);
  l.recompute = "selective";  // 34/t
  EXPECT_NEAR(estimate(m, c, 4, l).mem.activations, 24 * s * b * h * 34 / t, 1);
  // A 1F1B pipeline's first stage holds p micro-batches of its layers: all of them.
  l.pp = 4, l.dp = 1;
  EXPECT_NEAR(estimate(m, c, 8, l).mem.activations, 24 * s * b * h * 34 / t, 1);
}

// The loom engine's activations are the executor's own: a stage's store,
// room and scratch as GptStage lays them out, under each recompute policy,
// with 16-bit packed records, and for a mixture of experts.
TEST(Plan, LoomMemoryIsTheExecutorsOwn) {
  struct Case {
    const char* policy;
    bool bf16, moe;
  };
  for (const Case& k :
       {Case{"none", false, false}, Case{"selective", false, false}, Case{"full", false, false},
        Case{"none", true, false}, Case{"selective", true, false}, Case{"none", false, true},
        Case{"selective", false, true}, Case{"none", true, true}, Case{"full", false, true}}) {
    GptConfig g;
    g.n_layer = 3, g.n_embd = 64, g.n_head = 4, g.vocab_size = 300, g.seq_len = 32;
    json mj = {{"n_layer", 3}, {"n_embd", 64}, {"n_head", 4}, {"vocab_size", 300}, {"seq_len", 32}};
    if (k.moe) {
      g.moe_experts = 4, g.moe_top_k = 2, g.moe_every = 2;
      mj["moe"] = {{"num_experts", 4}, {"top_k", 2}, {"every_n_layers", 2}};
    }
    const ModelShape m = parse_model(mj, "test");
    Layout l;
    l.micro = 3;
    l.recompute = k.policy;
    l.precision = k.bf16 ? "bf16" : "f32";
    CheckpointPolicy policy;
    policy.kind = CheckpointPolicy::parse(k.policy);
    policy.records = k.bf16 ? DType::kBF16 : DType::kF32;
    for (const auto& [first, last] : {std::pair{0, 2}, std::pair{1, 3}, std::pair{0, 3}}) {
      GptStage<float> stage(g, StageSpec{first, last});
      stage.set_plan(stage.plan(policy, 3, 32));
      const ChunkBytes b = loom_chunk_bytes(m, l, first, last, first == 0, last == 3);
      const std::string what = format("{} {} {} [{}, {})", k.policy, k.bf16 ? "bf16" : "f32",
                                      k.moe ? "moe" : "dense", first, last);
      EXPECT_EQ(b.store, double(stage.store_bytes(3, 32))) << what;
      EXPECT_EQ(b.room, double(stage.room_bytes(3, 32))) << what;
    }
  }
}

// Narayanan et al. 2021, Table 1, against configs/clusters/selene-a100.json
// (its three free constants chosen on rows 1, 3, 5, 7 and 9; the others
// held out): the published layout's predicted TFLOP/s per GPU within 10% of
// the published figure, and that layout first or within 5% of the best
// the search finds; except the 39.1B row, the known miss: Megatron-LM
// interleaves only from pp 3, and the interleaved tp 2 x pp 8 layout is
// predicted 17.8% faster than the published tp 8 x pp 2 (docs/plan.md).
TEST(Plan, MegatronWeakScalingTable) {
  const ClusterSpec c =
      read_cluster(std::string(LOOM_SOURCE_DIR) + "/configs/clusters/selene-a100.json");
  struct Row {
    int64_t heads, hidden, layers;
    int tp, pp, dp, gpus;
    int64_t batch;
    double tflops;
  };
  const Row rows[] = {
      {24, 2304, 24, 1, 1, 32, 32, 512, 137},       {32, 3072, 30, 2, 1, 32, 64, 512, 138},
      {32, 4096, 36, 4, 1, 32, 128, 512, 142},      {48, 6144, 40, 8, 1, 32, 256, 1024, 135},
      {64, 8192, 48, 8, 2, 32, 512, 1536, 138},     {80, 10240, 60, 8, 4, 32, 1024, 1792, 140},
      {96, 12288, 80, 8, 8, 24, 1536, 2304, 148},   {128, 16384, 96, 8, 16, 15, 1920, 2160, 155},
      {128, 20480, 105, 8, 35, 9, 2520, 2520, 163}, {160, 25600, 128, 8, 64, 6, 3072, 3072, 163},
  };
  for (const Row& r : rows) {
    const ModelShape m = gpt(r.layers, r.hidden, r.heads);
    PlanOptions o;
    o.gpus = r.gpus, o.batch = r.batch, o.top = 0;
    o.engine = engine_named("megatron-2021");
    o.constraint = parse_layout("recompute=full,zero=0,precision=fp16");
    const std::vector<Estimate> all = search(m, c, o);
    o.constraint = parse_layout(
        format("tp={},pp={},dp={},recompute=full,zero=0,precision=fp16", r.tp, r.pp, r.dp));
    const Estimate published = search(m, c, o).at(0);
    EXPECT_NEAR(published.hw_tflops_per_gpu / r.tflops, 1, 0.10) << r.hidden;
    if (r.hidden == 8192) continue;
    const double gap = all.at(0).tokens_per_s / published.tokens_per_s - 1;
    EXPECT_LE(gap, 0.05) << r.hidden;
  }
}

// What crosses the data-parallel group, by ZeRO stage (nothing hidden
// behind the backward): stage 0 all-reduces the gradients once, stage 1
// all-gathers the updated parameters too (half an all-reduce), stage 2
// reduce-scatters every micro-batch's gradients and all-gathers once.
TEST(Plan, DataParallelTrafficFollowsTheStage) {
  const ClusterSpec c = parse_cluster(selene(), "selene");
  const ModelShape m = gpt(24, 2304, 24);
  Engine exposed;
  exposed.dp_overlap = false;
  Layout l;
  l.tp = 1, l.dp = 16, l.micro = 2;  // 4 micro-batches of a batch of 128
  l.zero = 0;
  const double all_reduce = estimate(m, c, 128, l, exposed).dp_exposed_s;
  // A ring all-reduce of the 16-bit gradients (all but ln_f's on the one
  // stage's first device) over 16 ranks, across nodes: 2 (n-1)/n of the
  // bytes, 2 (n-1) latencies.
  const double psi = m.params() - 2 * 2304.0;
  EXPECT_NEAR(all_reduce, 2.0 * 15 / 16 * psi * 2 / 25e9 + 2 * 15 * 5e-6, 1e-12);
  l.zero = 1;
  EXPECT_NEAR(estimate(m, c, 128, l, exposed).dp_exposed_s / all_reduce, 1.5, 1e-12);
  l.zero = 2;
  EXPECT_NEAR(estimate(m, c, 128, l, exposed).dp_exposed_s / all_reduce, 4 * 0.5 + 0.5, 1e-12);
  // With the overlap, stage 0's all-reduce hides behind the backward.
  l.zero = 0;
  EXPECT_LT(estimate(m, c, 128, l).dp_exposed_s, all_reduce);
}

// Experts' model states are divided over their own data-parallel group
// (dp / ep), the dense ones over dp.
TEST(Plan, ExpertStatesShardOverTheirOwnGroup) {
  const ClusterSpec c = parse_cluster(selene(), "selene");
  ModelShape m = gpt(24, 2304, 24);
  m.experts = 8, m.top_k = 2;
  Layout l;
  l.tp = 1, l.dp = 8, l.ep = 4, l.zero = 1;
  const double h = 2304, expert = 8 * h * h + 5 * h;
  const double psi_experts = 24 * 2 * expert;  // 8 experts over ep 4, a layer
  const double psi_dense = m.params() - 24 * 8 * expert - 2 * h;
  EXPECT_NEAR(estimate(m, c, 8, l).mem.optimizer / (12 * (psi_dense / 8 + psi_experts / 2)), 1,
              1e-12);
  EXPECT_NEAR(estimate(m, c, 8, l).mem.params / (2 * (psi_dense + psi_experts)), 1, 1e-12);
}

// What the engine cannot run is refused by estimate() with its reason,
// never searched, and named when nothing else is left.
TEST(Plan, EnginesRefuseWhatTheyCannotRun) {
  const ClusterSpec c = parse_cluster(selene(), "selene");
  const ModelShape dense = gpt(24, 2304, 24);
  Layout l;
  l.tp = 2, l.cp = 2, l.dp = 2;
  EXPECT_NO_THROW(estimate(dense, c, 8, l));
  EXPECT_EQ(test::error_of([&] { estimate(dense, c, 8, l, engine_named("megatron-2021")); }),
            l.describe() + ": the megatron-2021 engine has no context parallelism");
  l.cp = 3, l.dp = 1;  // loom's chunks: seq_len in 2 x cp of them
  EXPECT_EQ(test::error_of([&] { estimate(dense, c, 8, l); }),
            l.describe() + ": seq_len 2048 does not divide into 2 x cp = 6 chunks");
  ModelShape moe = dense;
  moe.experts = 8, moe.top_k = 2;
  l.cp = 1, l.sp = true;
  EXPECT_EQ(test::error_of([&] { estimate(moe, c, 8, l); }),
            l.describe() + ": the loom engine runs no expert layers under sequence parallelism");
  l.sp = false, l.pp = 2, l.dp = 1, l.v = 2, l.zero = 0, l.schedule = "interleaved";
  EXPECT_NO_THROW(estimate(dense, c, 8, l));
  EXPECT_EQ(test::error_of([&] { estimate(dense, c, 8, l, engine_named("megatron-2021")); }),
            l.describe() + ": the megatron-2021 engine interleaves from pp 3");
  PlanOptions o;
  o.gpus = 4, o.batch = 8, o.top = 0;
  o.engine = engine_named("megatron-2021");
  for (const Estimate& e : search(dense, c, o)) {
    EXPECT_EQ(e.layout.zero, 0);
    EXPECT_TRUE(e.layout.schedule != "interleaved" || e.layout.pp >= 3);
  }
  o.constraint = parse_layout("pp=2,schedule=interleaved");
  const std::string msg = test::error_of([&] { search(dense, c, o); });
  EXPECT_EQ(msg.rfind("no layout of 4 GPUs runs the model (24 layers, 24 heads) and the batch 8 "
                      "with --layout's sizes on the megatron-2021 engine: of the ",
                      0),
            0u)
      << msg;
  EXPECT_NE(msg.find(": the megatron-2021 engine interleaves from pp 3"), std::string::npos) << msg;
  // Fixed keys that make no layout at all: named, not searched around.
  o.constraint = parse_layout("pp=1,schedule=interleaved");
  EXPECT_EQ(test::error_of([&] {
              search(dense, c, o);
            }).rfind("no layout of 4 GPUs with --layout's sizes: ", 0),
            0u);
  EXPECT_NE(test::error_of([&] { search(dense, c, o); }).find(": a schedule needs pp > 1"),
            std::string::npos);
}

TEST(Plan, ClusterFilesAreChecked) {
  EXPECT_EQ(parse_cluster(selene(), "selene").node.bandwidth, 300e9);
  json j = selene();
  j["gpu"].erase("memory_bytes");
  EXPECT_EQ(test::error_of([&] { parse_cluster(j, "c.json"); }),
            "c.json: gpu.memory_bytes is missing");
  j = selene();
  j["links"]["cluster"]["bandwidth_GBps"] = -25;
  EXPECT_EQ(test::error_of([&] { parse_cluster(j, "c.json"); }),
            "c.json: links.cluster.bandwidth_GBps must be > 0, not -25");
  j = selene();
  j["gpu"]["peak_tflops_16bit"] = "fast";
  EXPECT_EQ(test::error_of([&] { parse_cluster(j, "c.json"); }),
            "c.json: gpu.peak_tflops_16bit must be a number, not \"fast\"");
  j = selene();
  j["links"]["node"] = 300;
  EXPECT_EQ(test::error_of([&] { parse_cluster(j, "c.json"); }),
            "c.json: links.node is a JSON object, not 300");
  j = selene();
  j["gpu"]["gemm_efficiency"]["max"] = 1.5;
  EXPECT_NE(test::error_of([&] { parse_cluster(j, "c.json"); }).find("must be <= 1"),
            std::string::npos);
}

TEST(Plan, LayoutsAreParsedAndChecked) {
  const LayoutConstraint k =
      parse_layout("tp=8,pp=35,v=3,recompute=selective,sp=true,schedule=interleaved");
  EXPECT_EQ(k.values.tp, 8);
  EXPECT_EQ(k.values.pp, 35);
  EXPECT_TRUE(k.has("recompute") && !k.has("dp"));
  EXPECT_EQ(
      test::error_of([] { parse_layout("tp=8,tq=2"); }).rfind("--layout: unknown key 'tq'", 0), 0u);
  EXPECT_EQ(test::error_of([] { parse_layout("zero=4"); }),
            "--layout: zero must be 0, 1, 2 or 3, not '4'");
  EXPECT_EQ(test::error_of([] { parse_layout("tp=0"); }),
            "--layout: tp must be a whole number from 1 to 999999999, not '0'");
  EXPECT_EQ(test::error_of([] { parse_layout("tp=2,tp=4"); }), "--layout: tp given twice");
  EXPECT_EQ(
      test::error_of([] { parse_layout("micro=99999999999999999999"); }),
      "--layout: micro must be a whole number from 1 to 999999999, not '99999999999999999999'");
  EXPECT_EQ(test::error_of([] {
              parse_model(json::parse(R"({"n_layer": 2, "n_embd": 8, "n_head": 2,
                "vocab_size": 10, "seq_len": 4, "moe": {"top_k": 1}})"),
                          "m.json");
            }),
            "m.json: model.moe.num_experts is missing");
}

TEST(Plan, SearchPrunesWhatDoesNotFitAndRanksByThroughput) {
  const ClusterSpec c = parse_cluster(selene(), "selene");
  PlanOptions o;
  o.gpus = 64, o.batch = 512, o.top = 0;
  const std::vector<Estimate> all = search(gpt(30, 3072, 32), c, o);
  ASSERT_FALSE(all.empty());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_TRUE(all[i].fits);
    EXPECT_LE(all[i].mem.total(), c.memory_bytes - c.reserved_bytes);
    EXPECT_EQ(all[i].layout.gpus(), 64);
    if (i) {
      EXPECT_GE(all[i - 1].tokens_per_s, all[i].tokens_per_s);
    }
  }
  EXPECT_GT(layouts_considered(), int64_t(all.size()));  // some did not fit
  // --layout fixes what it names.
  o.constraint = parse_layout("tp=2,recompute=full");
  for (const Estimate& e : search(gpt(30, 3072, 32), c, o)) {
    EXPECT_EQ(e.layout.tp, 2);
    EXPECT_EQ(e.layout.recompute, "full");
  }
}

TEST(Plan, SearchSaysWhyNothingFits) {
  const ClusterSpec c = parse_cluster(selene(), "selene");
  PlanOptions o;
  o.gpus = 8, o.batch = 8;
  const std::string msg = test::error_of([&] { search(gpt(128, 25600, 160), c, o); });
  EXPECT_EQ(msg.rfind("the model fits on no layout of 8 x A100: the smallest (", 0), 0u) << msg;
  EXPECT_NE(msg.find(" GB more than the 82.9 GB there is"), std::string::npos) << msg;
  o.gpus = 7;  // 7 x 1 x 1 only, and 7 divides neither 128 layers nor 160 heads' powers of two
  o.constraint = parse_layout("dp=1");
  EXPECT_EQ(test::error_of([&] {
              search(gpt(128, 25600, 160), c, o);
            }).rfind("no layout of 7 GPUs: tp x pp x cp must divide it", 0),
            0u);
}

// --calibrate's fit: points on the curve give its constants back; where
// small GEMMs run faster (in cache), a flat curve at the large ones' rate.
TEST(Plan, CalibrationFitsTheEfficiencyCurve) {
  std::vector<GemmPoint> pts;
  for (double f : {0.01, 0.1, 1.0, 10.0, 100.0})
    pts.push_back({1, 1, 1, f, 100 * 0.8 * f / (f + 0.5)});
  const auto [mx, half] = fit_gemm_efficiency(pts, 100);
  EXPECT_NEAR(mx, 0.8, 1e-9);
  EXPECT_NEAR(half, 0.5, 1e-9);
  std::vector<GemmPoint> flat = {{1, 1, 1, 0.01, 120}, {1, 1, 1, 10, 90}};
  const auto [fm, fh] = fit_gemm_efficiency(flat, 100);
  EXPECT_NEAR(fm, 0.9, 1e-3);
  EXPECT_DOUBLE_EQ(fh, 1e-3);
  EXPECT_EQ(calibration_shapes(128, 256, 1000).size(), 10u);
}

}  // namespace
}  // namespace loom::plan
