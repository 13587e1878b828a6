#include "loom/parallel/zero/offload.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "loom/core/error.h"

namespace loom {

namespace fs = std::filesystem;

bool is_tmpfs(const std::string& dir) {
  struct statfs st;
  return ::statfs(dir.c_str(), &st) == 0 && st.f_type == TMPFS_MAGIC;
}

void check_writable_dir(const std::string& dir, const std::string& key) {
  LOOM_CHECK_KIND(kConfig, !dir.empty(), "{} is empty: give a folder for the optimizer files", key);
  std::error_code ec;
  LOOM_CHECK_KIND(kConfig, fs::is_directory(dir, ec), "{}: {} is not an existing folder", key, dir);
  // Writability as this process sees it (root ignores mode bits, read-only
  // mounts do not): create and remove a probe file.
  const std::string probe = (fs::path(dir) / (".loom-probe-" + std::to_string(getpid()))).string();
  int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
  LOOM_CHECK_KIND(kConfig, fd >= 0, "{}: cannot create files in {}: {}", key, dir,
                  std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

NvmeStore::NvmeStore(const std::string& dir, size_t bytes, int rank) : bytes_(bytes) {
  path_ = (fs::path(dir) /
           ("loom-optimizer-" + std::to_string(getpid()) + "-rank" + std::to_string(rank) + ".bin"))
              .string();
  int fd = ::open(path_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  LOOM_CHECK_KIND(kIo, fd >= 0, "{}: cannot create the optimizer file: {}", path_,
                  std::strerror(errno));
  // A zero-filled file of the full size (sparse until written).
  if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(path_.c_str());
    LOOM_FAIL(kIo, "{}: cannot size the optimizer file to {} bytes: {}", path_, bytes_,
              std::strerror(err));
  }
  if (bytes_ > 0) {
    base_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base_ == MAP_FAILED) {
      int err = errno;
      base_ = nullptr;
      ::close(fd);
      ::unlink(path_.c_str());
      LOOM_FAIL(kIo, "{}: cannot map the optimizer file: {}", path_, std::strerror(err));
    }
  }
  // The descriptor stays open for write-back (sync_file_range); the name goes.
  fd_ = fd;
  ::unlink(path_.c_str());
}

NvmeStore::~NvmeStore() {
  if (base_) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

void NvmeStore::release(size_t offset, size_t n) {
  if (!base_ || n == 0) return;
  // Whole pages around the range: the mapping is shared with the file, so
  // dropping a neighbour's page loses nothing (it is read back on use).
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t lo = offset / page * page;
  const size_t hi = std::min(bytes_, (offset + n + page - 1) / page * page);
  char* p = static_cast<char*>(base_);
  // Start writing the pages back to the file (without waiting), then drop
  // them from this process. Once written they are clean page cache, which the
  // kernel evicts under memory pressure; on tmpfs they stay in memory.
  ::sync_file_range(fd_, static_cast<off_t>(lo), static_cast<off_t>(hi - lo),
                    SYNC_FILE_RANGE_WRITE);
  ::madvise(p + lo, hi - lo, MADV_DONTNEED);
}

size_t NvmeStore::resident_bytes() const {
  if (!base_) return 0;
  std::ifstream in("/proc/self/smaps");
  const uintptr_t want = reinterpret_cast<uintptr_t>(base_);
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (line.find('-') != std::string::npos && (head >> std::hex >> lo >> dash >> hi) &&
        dash == '-') {
      inside = lo <= want && want < hi;
      continue;
    }
    if (inside && line.rfind("Rss:", 0) == 0) {
      std::istringstream f(line.substr(4));
      size_t kb = 0;
      f >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

}  // namespace loom
