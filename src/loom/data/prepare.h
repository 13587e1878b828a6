// `loom prepare-data`: text files in, train.bin + val.bin + meta.json out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom {

struct PrepareOptions {
  std::vector<std::string> inputs;  // files or folders (walked recursively, symlinks skipped)
  std::string tokenizer = "byte";
  double val_fraction = 0.1;  // the last fraction of every file goes to validation
  std::string out_dir;
  bool overwrite = false;
};

struct PrepareSummary {
  uint64_t files = 0, bytes = 0, train_tokens = 0, val_tokens = 0;
  double seconds = 0;
};

PrepareSummary prepare_data(const PrepareOptions& options);

// Byte offset of the first invalid UTF-8 sequence in `text`, or npos.
size_t find_invalid_utf8(const std::string& text);

}  // namespace loom
