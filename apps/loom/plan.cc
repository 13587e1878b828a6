// loom plan: the layouts of a model on a cluster, predicted memory and step
// time, best tokens/s first.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "loom/core/error.h"
#include "loom/io/fs.h"
#include "loom/plan/planner.h"

namespace loom::app {

namespace {

struct PlanArgs {
  std::string model, cluster, layout, engine = "loom";
  int gpus = 0, top = 10;
  int64_t batch = 0;
  bool json = false;
};

void print_table(const std::vector<plan::Estimate>& best) {
  std::printf("%-4s %-3s %-3s %-4s %-2s %-2s %-2s %-5s %-4s %-9s %-2s %-11s %9s %10s %8s %8s\n",
              "rank", "tp", "pp", "dp", "cp", "ep", "v", "micro", "zero", "recompute", "sp",
              "schedule", "step s", "tokens/s", "TFLOP/s", "mem GB");
  int k = 0;
  for (const plan::Estimate& e : best) {
    const plan::Layout& l = e.layout;
    std::printf(
        "%-4d %-3d %-3d %-4d %-2d %-2d %-2d %-5ld %-4d %-9s %-2s %-11s %9.3f %10.0f %8.1f %8.1f\n",
        ++k, l.tp, l.pp, l.dp, l.cp, l.ep, l.v, long(l.micro), l.zero, l.recompute.c_str(),
        l.sp ? "y" : "n", l.schedule.c_str(), e.step_s, e.tokens_per_s, e.tflops_per_gpu,
        e.mem.total() / 1e9);
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Predict memory per device and step time of every layout of a model on a cluster, and "
      "rank those that fit by tokens/s (docs/plan.md)");
  cmd->add_option("--model", a->model, "A loom config, or its model section alone")->required();
  cmd->add_option("--cluster", a->cluster, "A cluster file (configs/clusters/)")->required();
  cmd->add_option("--gpus", a->gpus, "Devices in the job")->required()->check(CLI::PositiveNumber);
  cmd->add_option("--global-batch", a->batch, "Sequences per optimizer step")
      ->required()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--top", a->top, "Layouts shown (default 10)")->check(CLI::PositiveNumber);
  cmd->add_option("--layout", a->layout,
                  "Keys to fix, the rest searched: tp=8,pp=35,dp=1,cp=1,ep=1,v=3,micro=1,zero=1,"
                  "recompute=selective,sp=true,precision=bf16,schedule=interleaved");
  cmd->add_option("--engine", a->engine,
                  "What runs the layouts: loom (default), or megatron-2021 (the engine of "
                  "Megatron-LM's published 2021 runs, for comparing with them)");
  cmd->add_flag("--json", a->json, "One JSON object per layout, a line each");
  cmd->callback([a] {
    const nlohmann::json mj = nlohmann::json::parse(read_file(a->model), nullptr, false);
    LOOM_CHECK_KIND(kConfig, !mj.is_discarded(), "{}: not JSON", a->model);
    const plan::ModelShape m = plan::parse_model(mj, a->model);
    const plan::ClusterSpec c = plan::read_cluster(a->cluster);
    plan::PlanOptions o;
    o.gpus = a->gpus;
    o.batch = a->batch;
    o.top = a->top;
    o.constraint = plan::parse_layout(a->layout);
    o.engine = plan::engine_named(a->engine);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<plan::Estimate> best = plan::search(m, c, o);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (a->json) {
      for (const plan::Estimate& e : best) std::printf("%s\n", plan::to_json(e).dump().c_str());
      return;
    }
    std::printf(
        "loom: plan %s (%.2fB parameters, %ld layers, n_embd %ld, seq %ld) on %d x %s "
        "(%s), global batch %ld\n",
        a->model.c_str(), m.params() / 1e9, long(m.n_layer), long(m.hidden), long(m.seq), a->gpus,
        c.device.c_str(), c.name.c_str(), long(a->batch));
    print_table(best);
    std::printf("loom: %ld layouts considered in %.2f s; the best %zu that fit shown\n",
                long(plan::layouts_considered()), seconds, best.size());
  });
}

}  // namespace loom::app
