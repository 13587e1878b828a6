// loom config: the config's key table, and a config checked and resolved
// without training.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "loom/train/config.h"
#include "loom/train/config_keys.h"

namespace loom::app {

void add_config_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("config", "The config's keys; check a config");
  cmd->require_subcommand(1);
  CLI::App* keys = cmd->add_subcommand(
      "keys", "Every key with its type, default and meaning (docs/config.md's table)");
  keys->callback([] { std::fputs(config_keys_markdown().c_str(), stdout); });
  struct CheckArgs {
    std::string config;
    std::vector<std::string> overrides;
    int world = 1;
  };
  auto args = std::make_shared<CheckArgs>();
  CLI::App* check = cmd->add_subcommand(
      "check", "Validate a config and print it resolved (config.resolved.json), training nothing");
  check->add_option("--config", args->config, "Config file (JSON)")->required();
  check->add_option("--set", args->overrides, "Override a key: section.key=value (repeatable)");
  check->add_option("--world", args->world, "The job's ranks (default 1)");
  check->callback([args] {
    const Config c = load_config(args->config, args->overrides, args->world);
    std::printf("%s\n", c.resolved.dump(2).c_str());
  });
}

}  // namespace loom::app
