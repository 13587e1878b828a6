#include "loom/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "loom/core/error.h"
#include "loom/io/fs.h"

namespace loom {

void write_token_file(const std::string& path, const std::vector<uint32_t>& tokens,
                      uint32_t vocab_size) {
  const uint32_t width = vocab_size <= 65536 ? 2 : 4;
  std::string bytes(kTokenHeaderBytes + tokens.size() * width, '\0');
  char* p = bytes.data();
  std::memcpy(p, kTokenMagic, 8);
  std::memcpy(p + 8, &kTokenVersion, 4);
  std::memcpy(p + 12, &width, 4);
  uint64_t count = tokens.size();
  std::memcpy(p + 16, &count, 8);
  std::memcpy(p + 24, &vocab_size, 4);
  // x86 and ARM Linux are little-endian, the file's byte order.
  char* body = p + kTokenHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    LOOM_CHECK_KIND(kData, tokens[i] < vocab_size,
                    "{}: token {} at index {} is beyond vocabulary {}", path, tokens[i], i,
                    vocab_size);
    if (width == 2) {
      uint16_t t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(body + i * 2, &t, 2);
    } else {
      std::memcpy(body + i * 4, &tokens[i], 4);
    }
  }
  write_file_atomic(path, bytes);
}

TokenFile::TokenFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  LOOM_CHECK_KIND(kData, fd >= 0, "{}: cannot open token file: {}", path, std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  map_bytes_ = static_cast<size_t>(st.st_size);
  if (map_bytes_ < kTokenHeaderBytes) {
    ::close(fd);
    LOOM_FAIL(kData, "{}: not a token file ({} bytes, shorter than the {}-byte header)", path,
              map_bytes_, kTokenHeaderBytes);
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  LOOM_CHECK_KIND(kData, map_ != MAP_FAILED, "{}: mmap failed: {}", path, std::strerror(errno));
  const char* p = static_cast<const char*>(map_);
  uint32_t version = 0;
  std::memcpy(&version, p + 8, 4);
  std::memcpy(&width_, p + 12, 4);
  std::memcpy(&count_, p + 16, 8);
  std::memcpy(&vocab_, p + 24, 4);
  auto fail = [&](const std::string& why) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    LOOM_FAIL(kData, "{}: {}", path, why);
  };
  if (std::memcmp(p, kTokenMagic, 8) != 0) fail("not a token file (wrong magic)");
  if (version != kTokenVersion) fail(format("unsupported token file version {}", version));
  if (width_ != 2 && width_ != 4) fail(format("bad token width {}", width_));
  // Compared without multiplying the header's count (it could wrap).
  const uint64_t body = map_bytes_ - kTokenHeaderBytes;
  if (count_ > body / width_ || count_ * width_ != body) {
    const std::string want = count_ <= (UINT64_MAX - kTokenHeaderBytes) / width_
                                 ? format("{} bytes", kTokenHeaderBytes + count_ * width_)
                                 : std::string("more bytes than a file can have");
    fail(
        format("truncated or oversized body: header says {} tokens ({}) but the file has {} "
               "bytes",
               count_, want, map_bytes_));
  }
  tokens_ = p + kTokenHeaderBytes;
}

TokenFile::~TokenFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

}  // namespace loom
