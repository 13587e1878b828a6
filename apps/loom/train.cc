// loom train --config FILE [--set key=value]... [--out DIR] [--overwrite]
//            [--resume DIR|latest] [--init-from FILE.safetensors]
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/comm/parallel_context.h"
#include "loom/core/threads.h"
#include "loom/train/config.h"
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
};

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

void run_train(const TrainArgs& args, MpiRuntime* rt) {
  const int world = rt ? rt->world_size() : 1;
  Config config = load_config(args.config, args.overrides, world);
  ThreadConfig threads = configure_threads();
  RunOptions options;
  options.out_dir =
      args.out.empty() ? (std::filesystem::path("runs") / config.train.name).string() : args.out;
  options.overwrite = args.overwrite;
  options.resume = args.resume;
  options.init_from = args.init_from;
  // The grid from the parallel.* keys (parse_config checked they fit the job).
  const GridShape shape{world, config.parallel.tensor, config.parallel.pipeline,
                        config.parallel.expert};
  options.parallel = make_parallel_context(rt ? rt->world(config.comm) : nullptr, shape);
  Trainer trainer(std::move(config), options, threads);
  trainer.run();
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
  cmd->callback([args] {
    // Under mpirun every rank is a data-parallel replica; otherwise one process.
    if (launched_by_mpi()) {
      MpiRuntime rt(nullptr, nullptr);
      try {
        run_train(*args, &rt);
      } catch (const std::exception& e) {
        rt.abort(e.what());  // other ranks may wait in a collective: end the job
      }
      return;
    }
    run_train(*args, nullptr);
  });
}

}  // namespace loom::app
