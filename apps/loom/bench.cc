// loom bench gemm | train: figures, never pass/fail.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/core/threads.h"
#include "loom/data/tokenizer.h"
#include "loom/io/fs.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/cpu/gemm_census.h"
#include "loom/profile/gemm_peak.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"

namespace loom::app {

namespace {

struct GemmArgs {
  std::vector<int64_t> sizes = {512, 1024, 2048, 3072};
  int reps = 7;
  std::vector<std::string> backends;          // empty: every backend in this build
  std::vector<std::string> dtypes = {"f32"};  // with bf16: oneDNN's matmul in f32 and bf16
  std::string model;                          // a config: its GEMM shapes too
  bool json = false;
};

struct TrainBenchArgs {
  std::string config;
  std::vector<std::string> overrides;
  int64_t steps = 10;
  int64_t warmup = 2;
  bool ceiling = false;
  int ceiling_rounds = 3;
  bool json = false;
};

struct TokenizeBenchArgs {
  std::string tokenizer = "gpt2";
  std::vector<std::string> inputs;
  int reps = 3;
  bool json = false;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// An MFU denominator as `loom bench gemm` measured it again.
void print_mfu_peak(const char* path, const char* what, const PeakGflops& p) {
  std::printf("MFU denominator, %s: %.1f GFLOP/s (%s; ", path, p.gflops, what);
  if (p.cache_file.empty())
    std::printf("measured now; no cache: neither XDG_CACHE_HOME nor HOME is set)\n");
  else if (p.was <= 0)
    std::printf("measured now, cached in %s)\n", p.cache_file.c_str());
  else if (p.gflops > p.was)
    std::printf("raised from the %.1f cached in %s)\n", p.was, p.cache_file.c_str());
  else
    std::printf("cached in %s; %.1f measured now)\n", p.cache_file.c_str(), p.measured);
}

void run_gemm(const GemmArgs& a) {
  ThreadConfig threads = configure_threads();
  std::vector<cpu::GemmBackend> backends;
  for (const std::string& name : a.backends) {
    LOOM_CHECK_KIND(kConfig, name == "openblas" || name == "onednn",
                    "--backend {}: unknown (expected openblas or onednn)", name);
    backends.push_back(name == "onednn" ? cpu::GemmBackend::kOneDnn : cpu::GemmBackend::kOpenBlas);
  }
  if (backends.empty())
    for (auto b : {cpu::GemmBackend::kOpenBlas, cpu::GemmBackend::kOneDnn})
      if (cpu::gemm_backend_available(b)) backends.push_back(b);
  // Each backend's sizes; the peak is the best median of any backend.
  nlohmann::json per = nlohmann::json::object();
  double peak = 0;
  std::string best;
  std::vector<GemmBenchResult> best_results;
  if (!a.json) {
    std::printf("# %s\n", describe(threads).c_str());
    if (!threads.warning.empty()) std::printf("# warning: %s\n", threads.warning.c_str());
  }
  for (cpu::GemmBackend b : backends) {
    cpu::check_gemm_backend(b);
    const auto results = bench_gemm(b, a.sizes, a.reps);
    double top = 0;
    nlohmann::json sizes = nlohmann::json::array();
    for (const auto& r : results) {
      top = std::max(top, r.median_gflops);
      sizes.push_back(
          {{"n", r.n}, {"median_gflops", r.median_gflops}, {"best_gflops", r.best_gflops}});
    }
    per[cpu::gemm_backend_name(b)] = {
        {"isa", cpu::gemm_backend_isa(b)}, {"peak_gflops", top}, {"sizes", sizes}};
    if (top > peak) peak = top, best = cpu::gemm_backend_name(b), best_results = results;
    if (!a.json) {
      std::printf("%s (%s)\n%8s %14s %14s\n", cpu::gemm_backend_name(b),
                  cpu::gemm_backend_isa(b).c_str(), "n", "median GFLOP/s", "best GFLOP/s");
      for (const auto& r : results)
        std::printf("%8ld %14.1f %14.1f\n", long(r.n), r.median_gflops, r.best_gflops);
    }
  }
  // oneDNN's matmul primitive in f32 and bf16 (f32 accumulation), at the
  // square sizes and at a model's own GEMM shapes.
  nlohmann::json matmul = nlohmann::json::array();
  const bool bf16 = std::find(a.dtypes.begin(), a.dtypes.end(), "bf16") != a.dtypes.end();
  for (const std::string& d : a.dtypes)
    LOOM_CHECK_KIND(kConfig, d == "f32" || d == "bf16", "--dtype {}: unknown (expected f32, bf16)",
                    d);
  if (bf16) {
    LOOM_CHECK_KIND(kUnsupported, cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn),
                    "--dtype bf16 needs oneDNN, which this build lacks");
    struct Shape3 {
      std::string name;
      int64_t M, N, K;
    };
    std::vector<Shape3> shapes;
    for (int64_t n : a.sizes) shapes.push_back({format("{}^3", n), n, n, n});
    if (!a.model.empty()) {
      const Config c = load_config(a.model, {});
      const int64_t BT = c.micro_batch * c.model.seq_len, C = c.model.n_embd;
      shapes.push_back({"c_attn", BT, 3 * C, C});
      shapes.push_back({"attn.c_proj", BT, C, C});
      shapes.push_back({"mlp.c_fc", BT, 4 * C, C});
      shapes.push_back({"mlp.c_proj", BT, C, 4 * C});
      shapes.push_back({"lm head", BT, c.model.padded_vocab(), C});
    }
    if (!a.json)
      std::printf("oneDNN matmul, f32 vs bf16 inputs (f32 accumulation)\n%14s %20s %14s %14s %7s\n",
                  "shape", "M x N x K", "f32 GFLOP/s", "bf16 GFLOP/s", "ratio");
    for (const Shape3& sh : shapes) {
      const double f = cpu::measure_matmul_gflops(sh.M, sh.N, sh.K, false, a.reps);
      const double h = cpu::measure_matmul_gflops(sh.M, sh.N, sh.K, true, a.reps);
      matmul.push_back({{"shape", sh.name},
                        {"M", sh.M},
                        {"N", sh.N},
                        {"K", sh.K},
                        {"f32_gflops", f},
                        {"bf16_gflops", h}});
      if (!a.json)
        std::printf("%14s %20s %14.1f %14.1f %6.2fx\n", sh.name.c_str(),
                    format("{} x {} x {}", sh.M, sh.N, sh.K).c_str(), f, h, h / f);
    }
  }
  const std::string warn = cpu::openblas_misdetection();
  // The MFU denominators runs take from the cache, measured again: a cached
  // figure this machine now beats is raised. The bf16 matmul's with --dtype
  // bf16, where it runs.
  const PeakGflops mfu = machine_peak_gflops(threads.threads, GemmPath::kF32Sgemm, true);
  PeakGflops mfu16;
  if (bf16 && cpu::gemm_16_uses_bf16_matmul(DType::kBF16))
    mfu16 = machine_peak_gflops(threads.threads, GemmPath::kBf16Matmul, true);
  if (a.json) {
    nlohmann::json sizes = nlohmann::json::array();
    for (const auto& r : best_results)
      sizes.push_back(
          {{"n", r.n}, {"median_gflops", r.median_gflops}, {"best_gflops", r.best_gflops}});
    nlohmann::json j = {{"threads", threads.threads},
                        {"peak_gflops", peak},
                        {"gemm_backend", best},
                        {"sizes", sizes},
                        {"backends", per},
                        {"mfu_peak_gflops", mfu.gflops},
                        {"mfu_peak_measured_gflops", mfu.measured},
                        {"mfu_peak_was_gflops", mfu.was}};
    if (mfu16.gflops > 0)
      j["mfu_peak_bf16_matmul"] = {
          {"gflops", mfu16.gflops}, {"measured_gflops", mfu16.measured}, {"was_gflops", mfu16.was}};
    if (!warn.empty()) j["warning"] = warn;
    if (bf16) j["matmul"] = matmul;
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  if (!warn.empty()) std::printf("# warning: %s\n", warn.c_str());
  std::printf("peak sgemm: %.1f GFLOP/s with %s (the largest median of any backend and size)\n",
              peak, best.c_str());
  print_mfu_peak("f32 sgemm", "the best backend's 2048^3 median of five", mfu);
  if (mfu16.gflops > 0) print_mfu_peak("bf16 matmul", "the 2048^3 median of five", mfu16);
}

// The GEMM-bound ceiling: one more step with a GEMM census open, then
// rounds of a timed step followed by each form it called replayed alone.
// A round's fraction is its replayed GEMM time over its step's time, both
// measured within the same few seconds, so that a machine whose speed
// drifts (a shared one) moves both alike; `fraction` is the rounds'
// median, each form's time the median of its replays, and `gemm_time_s`
// those forms' sum.
nlohmann::json gemm_ceiling(Trainer& trainer, double tokens, int rounds) {
  cpu::gemm_census_open();
  try {
    trainer.train_step();
  } catch (...) {
    cpu::gemm_census_close();
    throw;
  }
  const std::vector<cpu::GemmTally> tallies = cpu::gemm_census_close();
  LOOM_CHECK_KIND(kConfig, !tallies.empty(),
                  "bench train --ceiling: the step ran no CPU GEMMs (a device backend's GEMMs "
                  "are not counted)");
  std::vector<std::vector<double>> per_call(tallies.size());
  std::vector<double> steps, fractions;
  for (int r = 0; r < rounds; ++r) {
    steps.push_back(trainer.train_step().t_step);
    double gemm_s = 0;
    for (size_t f = 0; f < tallies.size(); ++f) {
      per_call[f].push_back(cpu::gemm_replay_seconds(tallies[f].form));
      gemm_s += per_call[f].back() * double(tallies[f].calls);
    }
    fractions.push_back(gemm_s / steps.back());
  }
  struct Row {
    std::string form;
    int64_t calls;
    double per_call_s, seconds, gflops;
  };
  std::vector<Row> rows;
  double gemm_flops = 0;
  for (size_t f = 0; f < tallies.size(); ++f) {
    const cpu::GemmTally& t = tallies[f];
    const double s = median(per_call[f]);
    rows.push_back({t.form.describe(), t.calls, s, s * double(t.calls), t.form.flops() / s / 1e9});
    gemm_flops += t.form.flops() * double(t.calls);
  }
  std::sort(rows.begin(), rows.end(),
            [](const Row& x, const Row& y) { return x.seconds > y.seconds; });
  nlohmann::json forms = nlohmann::json::array();
  for (const Row& r : rows)
    forms.push_back({{"form", r.form},
                     {"calls", r.calls},
                     {"seconds_per_call", r.per_call_s},
                     {"seconds", r.seconds},
                     {"gflops", r.gflops}});
  double gemm_s = 0;  // the forms' medians, which the list below adds up to
  for (const Row& r : rows) gemm_s += r.seconds;
  return {{"rounds", rounds},
          {"step_time_s", median(steps)},
          {"gemm_time_s", gemm_s},
          {"gemm_gflops", gemm_flops / gemm_s / 1e9},
          {"gemm_flops_per_token", gemm_flops / tokens},
          {"model_flops_per_token", trainer.model().flops_per_token()},
          {"tokens_per_s", tokens / gemm_s},
          {"fraction", median(fractions)},
          {"fractions", fractions},
          {"forms", forms}};
}

void run_train_bench(const TrainBenchArgs& a) {
  LOOM_CHECK_KIND(kConfig, a.steps > a.warmup, "--steps {} must exceed --warmup {}", a.steps,
                  a.warmup);
  std::vector<std::string> overrides = a.overrides;
  overrides.push_back("train.steps=" + std::to_string(a.steps));
  Config config = load_config(a.config, overrides);
  ThreadConfig threads = configure_threads();
  RunOptions options;
  options.quiet = true;
  options.remeasure_peak = true;
  Trainer trainer(std::move(config), options, threads);
  std::vector<double> step_times, recompute_times;
  for (int64_t s = 0; s < a.steps; ++s) {
    if (s == a.warmup) memory_tracker().reset_peaks();
    StepResult r = trainer.train_step();
    if (s >= a.warmup) step_times.push_back(r.t_step), recompute_times.push_back(r.t_recompute);
  }
  const Config& c = trainer.config();
  double step_s = median(step_times);
  double tokens = double(c.train_batch_size) * c.model.seq_len;
  double tps = tokens / step_s;
  double flops = trainer.model().flops_per_token() * tps;
  MemStats mem = memory_tracker().stats();
  nlohmann::json peak_bytes = nlohmann::json::object();
  for (int k = 0; k < kNumMemCategories; ++k)
    peak_bytes[std::string(mem_category_name(static_cast<MemCategory>(k)))] = mem.peak[k];
  nlohmann::json j = {{"config", a.config},
                      {"threads", threads.threads},
                      {"steps", a.steps},
                      {"warmup", a.warmup},
                      {"params", trainer.model().num_params()},
                      {"tokens_per_step", tokens},
                      {"step_time_s", step_s},
                      {"tokens_per_s", tps},
                      {"model_flops_per_s", flops},
                      {"gemm_path", trainer.gemm_path_name()},
                      {"peak_gflops", trainer.peak_gflops()},
                      {"mfu", flops / (trainer.peak_gflops() * 1e9)},
                      {"gemm_backend", trainer.gemm_backend_name()},
                      {"peak_bytes", peak_bytes}};
  // Activation checkpointing: the plan and the bytes it was made from.
  const GptStage<float>& stage = trainer.model();
  const int64_t B = c.micro_batch, Tn = c.model.seq_len;
  j["activation_checkpointing"] = {
      {"policy", CheckpointPolicy::name(c.checkpointing.policy.kind)},
      {"plan", stage.recompute_plan().describe()},
      {"store_bytes", stage.store_bytes(B, Tn)},
      {"room_bytes", stage.room_bytes(B, Tn)},
      {"block_bytes_whole",
       stage.block_bytes(B, Tn, Recompute::kNone, stage.recompute_plan().records)},
      {"block_bytes_full", stage.block_bytes(B, Tn, Recompute::kFull)},
      {"recompute_time_s", median(recompute_times)}};
  if (a.ceiling) j["gemm_ceiling"] = gemm_ceiling(trainer, tokens, a.ceiling_rounds);
  if (a.json) {
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s\n", j.dump(2).c_str());
}

void run_tokenize_bench(const TokenizeBenchArgs& a) {
  std::string text;
  for (const std::string& path : a.inputs) text += read_file(path);
  LOOM_CHECK_KIND(kData, !text.empty(), "bench tokenize: the inputs are empty");
  auto load0 = std::chrono::steady_clock::now();
  auto tok = make_tokenizer(a.tokenizer);
  double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load0).count();
  std::vector<double> mbps;
  size_t tokens = 0;
  for (int r = 0; r < a.reps; ++r) {
    // A fresh tokenizer each time: the word cache starts empty, as in prepare-data.
    auto fresh = make_tokenizer(a.tokenizer);
    auto t0 = std::chrono::steady_clock::now();
    tokens = fresh->encode(text).size();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    mbps.push_back(double(text.size()) / 1e6 / s);
  }
  double decode_mbps = 0;
  {
    auto ids = tok->encode(text);
    auto t0 = std::chrono::steady_clock::now();
    std::string back = tok->decode(ids);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    LOOM_CHECK(back == text, "decode(encode(text)) differs from the text");
    decode_mbps = double(text.size()) / 1e6 / s;
  }
  nlohmann::json j = {{"tokenizer", a.tokenizer},
                      {"bytes", text.size()},
                      {"tokens", tokens},
                      {"load_s", load_s},
                      {"encode_mb_per_s", median(mbps)},
                      {"decode_mb_per_s", decode_mbps}};
  std::printf("%s\n", a.json ? j.dump().c_str() : j.dump(2).c_str());
}

}  // namespace

void add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Measure this machine and loom");
  bench->require_subcommand(1);

  auto g = std::make_shared<GemmArgs>();
  CLI::App* gemm = bench->add_subcommand("gemm", "Peak sgemm GFLOP/s (the MFU denominator)");
  gemm->add_option("--sizes", g->sizes, "Square sizes n (n x n x n)")->delimiter(',');
  gemm->add_option("--reps", g->reps, "Timed repetitions per size")->check(CLI::PositiveNumber);
  gemm->add_option("--backend", g->backends, "openblas, onednn (default: every one in this build)")
      ->delimiter(',');
  gemm->add_option("--dtype", g->dtypes, "f32, bf16 (bf16: oneDNN's matmul in f32 and bf16 too)")
      ->delimiter(',');
  gemm->add_option("--model", g->model, "A config: with --dtype bf16, its GEMM shapes too");
  gemm->add_flag("--json", g->json, "One JSON object on stdout");
  gemm->callback([g] { run_gemm(*g); });

  auto t = std::make_shared<TrainBenchArgs>();
  CLI::App* train = bench->add_subcommand("train", "Training throughput, MFU and memory");
  train->add_option("--config", t->config, "Config file (JSON)")->required();
  train->add_option("--set", t->overrides, "Override a key: section.key=value (repeatable)");
  train->add_option("--steps", t->steps, "Steps in all, warm-up included")
      ->check(CLI::PositiveNumber);
  train->add_option("--warmup", t->warmup, "Steps excluded from timing")
      ->check(CLI::NonNegativeNumber);
  CLI::Option* ceiling = train->add_flag(
      "--ceiling", t->ceiling,
      "Also the GEMM-bound ceiling: the step's GEMMs counted and each replayed alone");
  train
      ->add_option("--ceiling-rounds", t->ceiling_rounds,
                   "--ceiling: rounds of a timed step and the replay (medians reported)")
      ->check(CLI::PositiveNumber)
      ->needs(ceiling);
  train->add_flag("--json", t->json, "One JSON object on stdout");
  train->callback([t] { run_train_bench(*t); });

  auto k = std::make_shared<TokenizeBenchArgs>();
  CLI::App* tokenize = bench->add_subcommand("tokenize", "Tokenizer throughput (one thread)");
  tokenize->add_option("--tokenizer", k->tokenizer, "byte or gpt2");
  tokenize->add_option("--input", k->inputs, "Text files")->required();
  tokenize->add_option("--reps", k->reps, "Timed repetitions")->check(CLI::PositiveNumber);
  tokenize->add_flag("--json", k->json, "One JSON object on stdout");
  tokenize->callback([k] { run_tokenize_bench(*k); });

  add_bench_comm_command(*bench);
}

}  // namespace loom::app
