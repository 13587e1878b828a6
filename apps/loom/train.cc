// loom train --config FILE [--set key=value]... [--out DIR] [--overwrite]
//            [--resume DIR|latest] [--init-from FILE.safetensors]
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/comm/parallel_context.h"
#include "loom/core/threads.h"
#include "loom/train/config.h"
#include "loom/train/job_check.h"
#include "loom/train/trainer.h"

namespace loom::app {

namespace {
struct TrainArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string out;
  bool overwrite = false;
  std::string resume;
  std::string init_from;
  int restart = 0;
  std::string restart_cause;
};

// What a run holds while it trains. It lives outside the error handler's
// try block, so an error ends a parallel job while all of it (the process
// groups with their posted receives, the ZeRO engine's gathers in flight) is
// still alive: nothing is destroyed, so nothing waits on a peer.
struct Run {
  RunOptions options;
  std::unique_ptr<Trainer> trainer;
};

void run_train(const TrainArgs& args, MpiRuntime& rt, Run& run) {
  // MPI decides whether this is a parallel job, under any launcher (mpirun,
  // srun, ...); without one it is a singleton world of one.
  const int world = rt.world_size();
  Config config = load_config(args.config, args.overrides, world);
  ThreadConfig threads = configure_threads(rt.node_size());
  RunOptions& options = run.options;
  options.out_dir =
      args.out.empty() ? (std::filesystem::path("runs") / config.train.name).string() : args.out;
  options.overwrite = args.overwrite;
  options.resume = args.resume;
  options.init_from = args.init_from;
  options.restart = args.restart;
  options.restart_cause = args.restart_cause;
  std::shared_ptr<MpiProcessGroup> group;
  if (world > 1) {
    // Before anything is built from it: every rank the same job, checked on
    // a group of default options (comm.debug may be what differs).
    CommOptions plain;
    plain.timeout_s = config.comm.timeout_s;
    check_same_job(*rt.world(plain), config.resolved, build_identity());
    group = rt.world(config.comm);
  }
  // The grid from the parallel.* keys (parse_config checked they fit the job).
  const GridShape shape{world, config.parallel.tensor, config.parallel.pipeline,
                        config.parallel.expert, config.parallel.context};
  options.parallel = make_parallel_context(group, shape);
  run.trainer = std::make_unique<Trainer>(std::move(config), options, threads);
  run.trainer->run();
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* cmd = app.add_subcommand("train", "Train a model from a JSON config");
  cmd->add_option("--config", args->config, "Config file (JSON)")->required();
  cmd->add_option("--set", args->overrides, "Override a key: section.key=value (repeatable)");
  cmd->add_option("--out", args->out, "Run folder (default runs/<train.name>)");
  cmd->add_flag("--overwrite", args->overwrite, "Allow writing into a non-empty run folder");
  cmd->add_option("--resume", args->resume,
                  "Continue from a checkpoint folder, or 'latest' in the run's checkpoint dir");
  cmd->add_option("--init-from", args->init_from,
                  "Start from Hugging Face GPT-2 weights (a .safetensors file)");
  cmd->add_option("--restart", args->restart,
                  "Set by loom launch: this run restarts the job for the Nth time (metrics.jsonl "
                  "marks it)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--restart-cause", args->restart_cause, "Set by loom launch: why it restarted");
  cmd->callback([args] {
    MpiRuntime rt(nullptr, nullptr);
    Run run;
    try {
      run_train(*args, rt, run);
    } catch (const std::exception& e) {
      // One process: main() reports it. A parallel job ends here, on every
      // rank, with this rank's message first, while `run` is still alive.
      if (rt.world_size() == 1) throw;
      rt.abort(e.what());
    }
  });
}

}  // namespace loom::app
