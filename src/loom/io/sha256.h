// SHA-256 (FIPS 180-4), for the source checksums in meta.json.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace loom {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  std::string hex_digest();  // finishes; the object is spent afterwards

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_hex(std::string_view data);

}  // namespace loom
