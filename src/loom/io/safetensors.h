// safetensors files: an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
// {...}}), then the raw tensor bytes, offsets relative to the end of the
// header. The format Hugging Face and PyTorch read with safetensors.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/io/sha256.h"

namespace loom {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // writer: source bytes; reader: into the file's bytes
  size_t bytes = 0;
};

// Writes entries in the given order, atomically (temporary file, fsync, rename).
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

// The same file written one tensor at a time, so no more than one tensor's
// bytes need be in memory: the entries (names, dtypes, shapes, byte sizes;
// no data) are declared up front, their bytes appended in that order, and
// commit() fsyncs the temporary file and renames it over `path`. A writer
// destroyed before commit() removes its temporary file.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // The next entry's bytes (entries()[written()].bytes of them).
  void append(const void* data, size_t bytes);
  size_t written() const { return next_; }
  void commit();
  // The file's size and SHA-256 (hex), hashed as it was written: valid
  // after commit(), so a manifest never reads the file back.
  size_t file_bytes() const { return file_bytes_; }
  const std::string& sha256() const { return digest_; }

 private:
  void write_all(const void* data, size_t bytes);
  std::string path_, tmp_;
  Sha256 hash_;
  size_t file_bytes_ = 0;
  std::string digest_;
  std::vector<SafetensorsEntry> entries_;
  size_t next_ = 0;
  int fd_ = -1;
};

// Maps a file (read-only; pages are read when a tensor's bytes are touched,
// so taking a few tensors of a large file reads only those) and validates its
// header: length within the file, valid JSON, known dtypes, shapes matching
// byte sizes, offsets inside the data, non-overlapping and covering it.
// Errors name the file and the tensor.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(const std::string& name) const;  // null when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // Releases this process's mapping of the whole pages in [p, p + n) (the
  // file stays cached by the system): a reader done with a tensor keeps
  // none of it resident.
  void drop(const void* p, size_t n) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace loom
