// File-system helpers that never leave a half-written file behind.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace loom {

// Writes `bytes` to `path` through a temporary file in the same folder,
// fsyncs it, renames it over `path` and fsyncs the folder, so the new name
// survives a crash too.
void write_file_atomic(const std::string& path, const std::string& bytes);

// fsyncs a file or folder (a folder: its entries, after a rename into it).
void fsync_path(const std::string& path);

// Parses `path` as JSON; Error(kData) naming the file and the parser's
// reason when it is not.
nlohmann::json read_json_file(const std::string& path);

std::string read_file(const std::string& path);

}  // namespace loom
