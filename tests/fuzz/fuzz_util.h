// Shared by the fuzz targets: a scratch file per process for parsers that
// read files, and the rule every target follows: bad input may throw
// loom::Error (the one-line message a user sees); anything else that
// escapes (another exception, a crash, a sanitizer report) is a finding.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace loom::fuzz {

// A path under /dev/shm (else /tmp) unique to this process and `name`.
inline std::string scratch(const std::string& name) {
  static const std::string dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  return dir + "/loom-fuzz-" + std::to_string(getpid()) + "-" + name;
}

inline void write(const std::string& path, const uint8_t* data, size_t size) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

}  // namespace loom::fuzz
