// File-system helpers that never leave a half-written file behind.
#pragma once

#include <string>

namespace loom {

// Writes `bytes` to `path` through a temporary file in the same folder,
// fsyncs it, then renames it over `path`.
void write_file_atomic(const std::string& path, const std::string& bytes);

std::string read_file(const std::string& path);

}  // namespace loom
