// loom tune: the planner's best layouts for a config on this job's ranks,
// each trained for a few steps, predicted against measured, and the fastest
// written as a config (DeepSpeed's autotuning, for this machine or a test
// cluster).
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/core/threads.h"
#include "loom/io/fs.h"
#include "loom/plan/planner.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"

namespace loom::app {

namespace {

struct TuneArgs {
  std::string config, cluster, out = "tuned.json", json_out;
  std::vector<std::string> overrides, layouts;
  double budget_minutes = 10;
  int top = 6, steps = 4;
};

// The config keys that set a layout.
std::vector<std::string> layout_keys(const plan::Layout& l, int64_t batch) {
  std::vector<std::string> k = {
      format("parallel.tensor={}", l.tp),
      format("parallel.pipeline={}", l.pp),
      format("parallel.expert={}", l.ep),
      format("parallel.context={}", l.cp),
      format("train_micro_batch_size_per_gpu={}", l.micro),
      format("gradient_accumulation_steps={}", batch / (int64_t(l.dp) * l.micro)),
      format("zero_optimization.stage={}", l.zero),
      "activation_checkpointing.policy=" + l.recompute,
      std::string("parallel.sequence_parallel=") + (l.sp ? "true" : "false"),
      std::string("bf16.enabled=") + (l.precision == "bf16" ? "true" : "false"),
      std::string("fp16.enabled=") + (l.precision == "fp16" ? "true" : "false"),
  };
  k.push_back("parallel.schedule=" + l.schedule);
  k.push_back(format("parallel.virtual_stages={}", l.v));
  return k;
}

// Sets "a.b.c=value" in j (value parsed as JSON).
void set_key(nlohmann::json& j, const std::string& kv) {
  const size_t eq = kv.find('=');
  const std::string path = kv.substr(0, eq);
  nlohmann::json* at = &j;
  size_t pos = 0;
  while (true) {
    const size_t dot = path.find('.', pos);
    const std::string key =
        path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (dot == std::string::npos) {
      (*at)[key] = nlohmann::json::parse(kv.substr(eq + 1), nullptr, false);
      if ((*at)[key].is_discarded()) (*at)[key] = kv.substr(eq + 1);
      return;
    }
    at = &(*at)[key];
    pos = dot + 1;
  }
}

struct Trial {
  plan::Estimate predicted;
  bool ran = false;
  std::string skipped;  // why it did not run
  double tokens_per_s = 0, step_s = 0, mem_bytes = 0;
  // Each category's peak over the steps (the largest rank's), and their sum.
  std::array<double, kNumMemCategories> mem{};
};

double error_pct(double predicted, double measured) {
  return measured > 0 ? 100 * (predicted - measured) / measured : 0;
}

nlohmann::json trial_json(const Trial& t) {
  nlohmann::json j = plan::to_json(t.predicted);
  j["ran"] = t.ran;
  if (!t.ran) {
    j["skipped"] = t.skipped;
    return j;
  }
  nlohmann::json mem = nlohmann::json::object();
  for (int c = 0; c < kNumMemCategories; ++c)
    mem[std::string(mem_category_name(static_cast<MemCategory>(c)))] = t.mem[size_t(c)];
  mem["total"] = t.mem_bytes;
  j["measured"] = {{"step_time_s", t.step_s}, {"tokens_per_s", t.tokens_per_s}, {"mem_bytes", mem}};
  j["error_pct"] = {{"step_time", error_pct(t.predicted.step_s, t.step_s)},
                    {"mem", error_pct(t.predicted.mem.total(), t.mem_bytes)}};
  return j;
}

// `holder` keeps the candidate being trained alive past an error, so that
// nothing waits on a peer while the job ends (as loom train does).
void run_tune(const TuneArgs& a, MpiRuntime& rt, std::unique_ptr<Trainer>& holder) {
  const int world = rt.world_size();
  const Config base = load_config(a.config, a.overrides, world);
  LOOM_CHECK_KIND(kConfig, !a.cluster.empty(),
                  "loom tune: --cluster is required (loom plan --calibrate writes one for this "
                  "machine)");
  const plan::ClusterSpec cluster = plan::read_cluster(a.cluster);
  const plan::ModelShape model = plan::parse_model(base.resolved, a.config);
  plan::PlanOptions o;
  o.gpus = world;
  o.batch = base.train_batch_size;
  o.top = 0;
  const std::string precision = base.precision == DType::kBF16  ? "bf16"
                                : base.precision == DType::kF16 ? "fp16"
                                                                : "f32";
  o.constraint =
      plan::parse_layout(format("precision={},cp=1,ep={}", precision, base.parallel.expert));
  // The best of each kind of layout: layouts that differ only in the ZeRO
  // stage are predicted alike on one host; the first of them in the
  // ranking stands for them.
  std::vector<plan::Estimate> best;
  std::vector<std::string> kinds;
  // --layout: exactly these layouts (dp what the ranks leave), no search.
  std::vector<std::string> refused;  // --layout's the planner refuses, with the reason
  for (const std::string& text : a.layouts) {
    const plan::LayoutConstraint k = plan::parse_layout(text);
    plan::Layout l = k.values;
    // What --layout does not name is the config's.
    const ParallelConfig& p = base.parallel;
    auto keep = [&](const char* key, auto& field, const auto& value) {
      if (!k.has(key)) field = value;
    };
    keep("tp", l.tp, p.tensor);
    keep("pp", l.pp, p.pipeline);
    keep("cp", l.cp, p.context);
    keep("ep", l.ep, p.expert);
    keep("micro", l.micro, base.micro_batch);
    keep("zero", l.zero, base.zero.stage);
    keep("recompute", l.recompute,
         std::string(CheckpointPolicy::name(base.checkpointing.policy.kind)));
    keep("sp", l.sp, p.sequence_parallel);
    keep("precision", l.precision, precision);
    keep("schedule", l.schedule, l.pp > 1 ? p.schedule : std::string("1f1b"));
    keep("v", l.v, l.schedule == "interleaved" ? p.virtual_stages : 1);
    keep("dp", l.dp, world / std::max(1, l.tp * l.pp * l.cp));
    try {
      LOOM_CHECK_KIND(kConfig, l.gpus() == world, "tp x pp x dp x cp = {}, not the {} ranks",
                      l.gpus(), world);
      LOOM_CHECK_KIND(kConfig,
                      l.recompute == "none" || l.recompute == "selective" || l.recompute == "full",
                      "the planner models recompute none, selective and full, not {}", l.recompute);
      best.push_back(plan::estimate(model, cluster, o.batch, l));
    } catch (const Error& e) {
      refused.push_back(format("--layout {}: {}", text, e.what()));
    }
  }
  if (rt.world_rank() == 0) {
    for (const std::string& r : refused) std::printf("loom: tune: skipped %s\n", r.c_str());
    std::fflush(stdout);
  }
  LOOM_CHECK_KIND(kConfig, a.layouts.empty() || !best.empty(),
                  "loom tune: every --layout was refused ({})", refused.front());
  if (!a.layouts.empty()) o.top = 1;  // the search below is skipped
  for (const plan::Estimate& e :
       a.layouts.empty() ? plan::search(model, cluster, o) : std::vector<plan::Estimate>{}) {
    plan::Layout l = e.layout;
    l.zero = 0;
    const std::string kind = l.describe();
    if (std::find(kinds.begin(), kinds.end(), kind) != kinds.end()) continue;
    kinds.push_back(kind);
    best.push_back(e);
    if (static_cast<int>(best.size()) == a.top) break;
  }
  const ThreadConfig threads = configure_threads(rt.node_size());
  std::shared_ptr<MpiProcessGroup> group;
  if (world > 1) group = rt.world(base.comm);
  const bool writer = rt.world_rank() == 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Trial> trials;
  for (const plan::Estimate& e : best) {
    Trial t;
    t.predicted = e;
    // Rank 0's clock decides for every rank.
    float spent = static_cast<float>(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 60);
    if (group) group->broadcast(&spent, 1, DType::kF32, 0)->wait();
    if (spent > a.budget_minutes) {
      t.skipped = format("past the budget of {} minutes", a.budget_minutes);
      trials.push_back(t);
      continue;
    }
    std::vector<std::string> keys = a.overrides;
    for (const std::string& k : layout_keys(e.layout, o.batch)) keys.push_back(k);
    keys.push_back(format("train.steps={}", a.steps));
    keys.push_back("train.eval_every=0");
    keys.push_back("checkpoint.every=0");
    keys.push_back("train.sample_tokens=0");
    Config c;
    try {
      c = load_config(a.config, keys, world);  // the same on every rank
    } catch (const Error& err) {
      t.skipped = err.what();
      trials.push_back(t);
      continue;
    }
    RunOptions ro;
    ro.quiet = true;
    ro.parallel =
        make_parallel_context(group, GridShape{world, c.parallel.tensor, c.parallel.pipeline,
                                               c.parallel.expert, c.parallel.context});
    holder.reset();
    holder = std::make_unique<Trainer>(std::move(c), ro, threads);
    const std::vector<StepResult> r = holder->run();
    // Medians of the steps after the first (which warms up).
    std::vector<double> rates, steps;
    for (size_t k = r.size() > 1 ? 1 : 0; k < r.size(); ++k) {
      rates.push_back(r[k].tokens_per_s);
      steps.push_back(r[k].t_step);
    }
    std::sort(rates.begin(), rates.end());
    std::sort(steps.begin(), steps.end());
    t.tokens_per_s = rates[rates.size() / 2];
    t.step_s = steps[steps.size() / 2];
    for (const StepResult& s : r)
      for (size_t c = 0; c < t.mem.size(); ++c)
        t.mem[c] = std::max(t.mem[c], double(s.mem.peak[c]));
    for (double m : t.mem) t.mem_bytes += m;
    t.ran = true;
    trials.push_back(t);
    if (writer) {
      std::printf("loom: tune %zu/%zu %s: %.0f tokens/s (predicted %.0f)\n", trials.size(),
                  best.size(), e.layout.describe().c_str(), t.tokens_per_s, e.tokens_per_s);
      std::fflush(stdout);
    }
  }
  if (!writer) return;
  const auto fastest = std::max_element(
      trials.begin(), trials.end(),
      [](const Trial& x, const Trial& y) { return x.tokens_per_s < y.tokens_per_s; });
  LOOM_CHECK_KIND(kConfig, fastest != trials.end() && fastest->ran,
                  "loom tune: no candidate ran ({})",
                  trials.empty() ? "the planner found none" : trials.front().skipped);
  std::printf("\n%-4s %-62s %10s %10s %7s %10s %10s %7s\n", "rank", "layout", "pred s", "step s",
              "err %", "pred MB", "peak MB", "err %");
  int k = 0;
  std::string lines;
  for (const Trial& t : trials) {
    ++k;
    lines += trial_json(t).dump() + "\n";
    if (!t.ran) {
      std::printf("%-4d %-62s skipped: %s\n", k, t.predicted.layout.describe().c_str(),
                  t.skipped.c_str());
      continue;
    }
    std::printf("%-4d %-62s %10.4f %10.4f %+7.1f %10.1f %10.1f %+7.1f%s\n", k,
                t.predicted.layout.describe().c_str(), t.predicted.step_s, t.step_s,
                error_pct(t.predicted.step_s, t.step_s), t.predicted.mem.total() / 1e6,
                t.mem_bytes / 1e6, error_pct(t.predicted.mem.total(), t.mem_bytes),
                &t == &*fastest ? "  <- fastest" : "");
  }
  if (!a.json_out.empty()) write_file_atomic(a.json_out, lines);
  // The config as given, with the fastest layout's keys.
  nlohmann::json j = nlohmann::json::parse(read_file(a.config));
  for (const std::string& kv : a.overrides) set_key(j, kv);
  for (const std::string& kv : layout_keys(fastest->predicted.layout, o.batch)) set_key(j, kv);
  write_file_atomic(a.out, j.dump(2) + "\n");
  std::printf("loom: tune: %s written: %s, %.0f tokens/s measured over %d steps\n", a.out.c_str(),
              fastest->predicted.layout.describe().c_str(), fastest->tokens_per_s, a.steps);
}

}  // namespace

void add_tune_command(CLI::App& app) {
  auto a = std::make_shared<TuneArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tune",
      "Train the planner's best layouts of a config for a few steps each on this job's ranks "
      "and write the fastest as a config (docs/plan.md)");
  cmd->add_option("--config", a->config, "The config to tune (its model, batch and data)")
      ->required();
  cmd->add_option("--cluster", a->cluster,
                  "This machine as a cluster file (loom plan --calibrate writes one)");
  cmd->add_option("--set", a->overrides, "Override a key: section.key=value (repeatable)");
  cmd->add_option("--top", a->top, "Candidates measured (default 6)")->check(CLI::PositiveNumber);
  cmd->add_option("--steps", a->steps, "Steps each (default 4; the first is not timed)")
      ->check(CLI::Range(2, 1000));
  cmd->add_option("--budget-minutes", a->budget_minutes,
                  "No candidate starts after this (default 10)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--out", a->out, "The config written (default tuned.json)");
  cmd->add_option("--layout", a->layouts,
                  "Measure this layout instead of the plan's best (repeatable; the keys of loom "
                  "plan --layout, dp what the ranks leave, the rest the config's)");
  cmd->add_option("--json", a->json_out,
                  "Also write each candidate, predicted and measured, as a JSON line to this file");
  cmd->callback([a] {
    MpiRuntime rt(nullptr, nullptr);
    std::unique_ptr<Trainer> holder;
    try {
      run_tune(*a, rt, holder);
    } catch (const std::exception& e) {
      if (rt.world_size() == 1) throw;
      rt.abort(e.what());
    }
  });
}

}  // namespace loom::app
