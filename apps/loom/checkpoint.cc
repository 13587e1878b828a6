// loom checkpoint consolidate DIR --out OUT
// loom checkpoint verify DIR
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "commands.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/core/threads.h"

namespace loom::app {

namespace {

// A checkpoint folder, or a checkpoints folder whose `latest` names one.
std::string checkpoint_dir(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::path(path) / "latest", ec))
    return resolve_checkpoint("latest", path);
  return path;
}

}  // namespace

void add_checkpoint_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("checkpoint", "Inspect and convert checkpoints");
  cmd->require_subcommand(1);

  auto src = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  CLI::App* cons = cmd->add_subcommand(
      "consolidate",
      "Write a checkpoint (sharded or whole, any layout) as a whole one: Hugging Face "
      "model.safetensors, whole optimizer moments, trainer state");
  cons->add_option("checkpoint", *src, "Checkpoint folder, or a checkpoints folder (its latest)")
      ->required();
  cons->add_option("--out", *out, "New folder to write")->required();
  cons->callback([src, out] {
    configure_threads();
    const std::string dir = checkpoint_dir(*src);
    const int64_t n = consolidate_checkpoint(dir, *out);
    std::printf(
        "loom: consolidated %s into %s (%ld tensors; model.safetensors loads with "
        "--init-from or Hugging Face)\n",
        dir.c_str(), out->c_str(), static_cast<long>(n));
  });

  auto vdir = std::make_shared<std::string>();
  CLI::App* verify =
      cmd->add_subcommand("verify", "Check a checkpoint's files against its manifest");
  verify->add_option("checkpoint", *vdir, "Checkpoint folder, or a checkpoints folder (its latest)")
      ->required();
  verify->callback([vdir] {
    const std::string dir = checkpoint_dir(*vdir);
    verify_checkpoint(dir);
    std::printf("loom: %s: every file matches manifest.json\n", dir.c_str());
  });
}

}  // namespace loom::app
