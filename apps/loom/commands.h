// Each subcommand registers its options and its action on the CLI app.
#pragma once

#include <CLI/CLI.hpp>

namespace loom::app {

void add_train_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_prepare_data_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_tokenize_command(CLI::App& app);
void add_checkpoint_command(CLI::App& app);
void add_launch_command(CLI::App& app);
void add_config_command(CLI::App& app);
void add_report_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_tune_command(CLI::App& app);
void add_bench_comm_command(CLI::App& bench);  // under `bench`

}  // namespace loom::app
