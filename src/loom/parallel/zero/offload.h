// Optimizer state kept in a file instead of memory (ZeRO's offload_optimizer
// with device "nvme"): one memory-mapped file per rank, whose pages are
// dropped from this process after each unit's update, so only the unit being
// updated is resident.
#pragma once

#include <cstddef>
#include <string>

namespace loom {

class NvmeStore {
 public:
  // Creates a file of `bytes` under `dir` (named after the process and rank),
  // maps it and removes its name, so nothing is left behind when the process
  // ends, however it ends.
  NvmeStore(const std::string& dir, size_t bytes, int rank);
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  float* data() const { return static_cast<float*>(base_); }
  size_t bytes() const { return bytes_; }
  // Writes back and drops the pages holding [offset, offset + n) bytes from
  // this process; the next access reads them back from the file.
  void release(size_t offset, size_t n);
  // Bytes of the mapping resident in this process now (from /proc/self/smaps).
  size_t resident_bytes() const;

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  int fd_ = -1;
  std::string path_;
};

// True when `dir` is on tmpfs (memory): offloading there saves nothing.
bool is_tmpfs(const std::string& dir);

// Throws Error(kConfig) naming `key` unless `dir` is an existing folder this
// process can create files in.
void check_writable_dir(const std::string& dir, const std::string& key);

}  // namespace loom
