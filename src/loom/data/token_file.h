// Token files: a 32-byte header then little-endian tokens, memory-mapped
// when read. Layout (docs/data.md):
//   0  char[8]  magic "LOOMTOK\0"
//   8  u32      version (1)
//   12 u32      token width in bytes (2 or 4)
//   16 u64      token count
//   24 u32      vocabulary size
//   28 u32      reserved (0)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom {

inline constexpr char kTokenMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', '\0'};
inline constexpr uint32_t kTokenVersion = 1;
inline constexpr size_t kTokenHeaderBytes = 32;

// Writes `tokens` to `path` atomically (temporary file, fsync, rename).
// Width 2 when vocab_size <= 65536, else 4.
void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens,
                      uint32_t vocab_size);

// A read-only memory-mapped token file; checked on open.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  uint64_t size() const { return count_; }
  uint32_t vocab_size() const { return vocab_; }
  const std::string& path() const { return path_; }
  uint32_t operator[](uint64_t i) const {
    return width_ == 2 ? static_cast<const uint16_t*>(tokens_)[i]
                       : static_cast<const uint32_t*>(tokens_)[i];
  }

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const void* tokens_ = nullptr;
  uint64_t count_ = 0;
  uint32_t width_ = 2, vocab_ = 0;
};

}  // namespace loom
