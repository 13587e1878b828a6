// loom: the command-line entry point. Parses arguments and hands over to the
// library; the only place that turns an error into an exit status.
#include <cstdio>
#include <exception>

#include "commands.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"

int main(int argc, char** argv) {
  loom::keep_freed_host_memory();
  CLI::App app{"loom: train transformer and mixture-of-experts models across processes"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "loom 0.1.0");
  loom::app::add_train_command(app);
  loom::app::add_bench_command(app);
  loom::app::add_prepare_data_command(app);
  loom::app::add_generate_command(app);
  loom::app::add_tokenize_command(app);
  loom::app::add_checkpoint_command(app);
  loom::app::add_launch_command(app);
  loom::app::add_config_command(app);
  loom::app::add_report_command(app);
  loom::app::add_plan_command(app);
  loom::app::add_tune_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
