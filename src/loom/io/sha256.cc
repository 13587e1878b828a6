#include "loom/io/sha256.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <openssl/evp.h>

#include "loom/core/error.h"

namespace loom {

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  if (ctx_ != nullptr && EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) == 1) return;
  EVP_MD_CTX_free(ctx_);
  LOOM_FAIL(kInternal, "SHA-256: libcrypto could not start a digest");
}

Sha256::~Sha256() {
  EVP_MD_CTX_free(ctx_);
}

void Sha256::update(const void* data, size_t n) {
  LOOM_CHECK(EVP_DigestUpdate(ctx_, data, n) == 1, "SHA-256: libcrypto update failed");
}

std::string Sha256::hex_digest() {
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  LOOM_CHECK(EVP_DigestFinal_ex(ctx_, d, &n) == 1 && n == 32, "SHA-256: libcrypto final failed");
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < n; ++i) out += kHex[d[i] >> 4], out += kHex[d[i] & 15];
  return out;
}

std::string sha256_hex(std::string_view data) {
  Sha256 s;
  s.update(data.data(), data.size());
  return s.hex_digest();
}

std::string sha256_file(const std::string& path, size_t* bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LOOM_CHECK_KIND(kIo, fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  Sha256 h;
  std::vector<char> buf(size_t{1} << 20);
  size_t total = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      LOOM_FAIL(kIo, "{}: cannot read: {}", path, std::strerror(err));
    }
    if (n == 0) break;
    h.update(buf.data(), static_cast<size_t>(n));
    total += static_cast<size_t>(n);
  }
  ::close(fd);
  if (bytes) *bytes = total;
  return h.hex_digest();
}

}  // namespace loom
