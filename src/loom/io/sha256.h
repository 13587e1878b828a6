// SHA-256, for checkpoint manifests and the source checksums in meta.json:
// OpenSSL's libcrypto, which uses the CPU's SHA instructions where it has
// them (about 1.7 GB/s a core on an AMD EPYC, nine times a portable loop),
// so hashing never holds a checkpoint save back.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX

namespace loom {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t n);
  std::string hex_digest();  // finishes; the object is spent afterwards

 private:
  evp_md_ctx_st* ctx_;
};

std::string sha256_hex(std::string_view data);
// The SHA-256 (hex) of a file read in pieces (never whole in memory); its
// size in *bytes. Error(kIo) naming the file when it cannot be read.
std::string sha256_file(const std::string& path, size_t* bytes);

}  // namespace loom
