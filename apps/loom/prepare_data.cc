// loom prepare-data --input PATH... --tokenizer byte [--val-fraction F] --out DIR
#include <cstdio>
#include <memory>

#include "commands.h"
#include "loom/data/prepare.h"

namespace loom::app {

void add_prepare_data_command(CLI::App& app) {
  auto o = std::make_shared<PrepareOptions>();
  CLI::App* cmd = app.add_subcommand("prepare-data", "Tokenize text files into token files");
  cmd->add_option("--input", o->inputs, "Text files or folders (repeatable)")->required();
  cmd->add_option("--tokenizer", o->tokenizer, "Tokenizer: byte");
  cmd->add_option("--val-fraction", o->val_fraction,
                  "Fraction of every file (its end) kept for validation");
  cmd->add_option("--out", o->out_dir, "Output folder")->required();
  cmd->add_flag("--overwrite", o->overwrite, "Replace existing token files");
  cmd->callback([o] {
    PrepareSummary s = prepare_data(*o);
    std::printf(
        "loom: %lu files, %lu bytes -> %lu train + %lu val tokens (%s) in %s "
        "(%.1f MB/s)\n",
        (unsigned long)s.files, (unsigned long)s.bytes, (unsigned long)s.train_tokens,
        (unsigned long)s.val_tokens, o->tokenizer.c_str(), o->out_dir.c_str(),
        double(s.bytes) / 1e6 / std::max(s.seconds, 1e-9));
  });
}

}  // namespace loom::app
