#include "loom/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/io/fs.h"

namespace loom {

using nlohmann::json;

namespace {
const char* st_dtype(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    default:
      break;
  }
  return "?";
}
}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter w(path, entries, metadata);
  for (const auto& e : entries) w.append(e.data, e.bytes);
  w.commit();
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), entries_(std::move(entries)) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& e : entries_) {
    header[e.name] = {{"dtype", st_dtype(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.bytes}}};
    offset += e.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data to 8 bytes
  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  LOOM_CHECK_KIND(kIo, fd_ >= 0, "{}: cannot create: {}", tmp_, std::strerror(errno));
  const uint64_t n = text.size();
  write_all(&n, 8);
  write_all(text.data(), text.size());
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void SafetensorsWriter::write_all(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  hash_.update(data, bytes);
  file_bytes_ += bytes;
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd_, p + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    LOOM_CHECK_KIND(kIo, n > 0, "{}: write failed: {}", tmp_, std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

void SafetensorsWriter::append(const void* data, size_t bytes) {
  LOOM_CHECK(next_ < entries_.size(), "{}: more tensors appended than the {} declared", path_,
             entries_.size());
  const SafetensorsEntry& e = entries_[next_];
  LOOM_CHECK(bytes == e.bytes, "{}: tensor '{}' declared {} bytes, got {}", path_, e.name, e.bytes,
             bytes);
  write_all(data, bytes);
  ++next_;
}

void SafetensorsWriter::commit() {
  LOOM_CHECK(next_ == entries_.size(), "{}: {} of {} tensors written at commit", path_, next_,
             entries_.size());
  bool ok = ::fsync(fd_) == 0;
  ok = (::close(fd_) == 0) && ok;
  fd_ = -1;
  if (!ok || std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    LOOM_FAIL(kIo, "{}: cannot write: {}", path_, std::strerror(err));
  }
  digest_ = hash_.hex_digest();
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LOOM_CHECK_KIND(kIo, fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    LOOM_FAIL(kIo, "{}: not a regular file", path);
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      LOOM_FAIL(kIo, "{}: mmap failed: {}", path, std::strerror(err));
    }
  } else {
    ::close(fd);
  }
  // The mapping is released if the header is rejected below.
  struct Unmap {
    SafetensorsFile* f;
    bool armed = true;
    ~Unmap() {
      if (armed && f->map_) ::munmap(f->map_, f->size_), f->map_ = nullptr;
    }
  } unmap{this};
  const std::string_view file(static_cast<const char*>(map_), size_);
  auto fail = [&](const std::string& why) { LOOM_FAIL(kData, "{}: {}", path, why); };
  if (file.size() < 8) fail(format("truncated safetensors file ({} bytes)", file.size()));
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  // As Hugging Face's reader does: a header is small; a huge length is damage.
  constexpr uint64_t kMaxHeader = 100'000'000;
  if (n > kMaxHeader)
    fail(format("header length {} exceeds the 100 MB a safetensors header may have", n));
  if (n > file.size() - 8)
    fail(format("header length {} is beyond the file ({} bytes)", n, file.size()));
  json header =
      json::parse(file.begin() + 8, file.begin() + 8 + static_cast<int64_t>(n), nullptr, false);
  if (header.is_discarded() || !header.is_object()) fail("header is not a JSON object");
  const size_t data_size = file.size() - 8 - n;
  const char* data = file.data() + 8 + n;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (v.is_object())
        for (const auto& [k, s] : v.items())
          if (s.is_string()) metadata_[k] = s.get<std::string>();
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets") || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2 || !v["shape"].is_array())
      fail(format("tensor '{}': malformed header entry", name));
    SafetensorsEntry e;
    e.name = name;
    std::string dt = v["dtype"].is_string() ? v["dtype"].get<std::string>() : "";
    if (dt == "F32")
      e.dtype = DType::kF32;
    else if (dt == "BF16")
      e.dtype = DType::kBF16;
    else if (dt == "F16")
      e.dtype = DType::kF16;
    else
      fail(format("tensor '{}': unsupported dtype {}", name, v["dtype"].dump()));
    // Dimensions whole and >= 0, their product (in bytes) without overflow.
    size_t numel = 1;
    const size_t limit = std::numeric_limits<size_t>::max() / 8;
    for (const json& d : v["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t{INT64_MAX})
        fail(format("tensor '{}': bad shape {}", name, v["shape"].dump()));
      const size_t x = d.get<size_t>();
      if (x != 0 && numel > limit / x)
        fail(format("tensor '{}': shape {} has more elements than memory can hold", name,
                    v["shape"].dump()));
      e.shape.push_back(static_cast<int64_t>(x));
      numel *= x;
    }
    const json& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(format("tensor '{}': bad data_offsets {}", name, off.dump()));
    size_t begin = off[0].get<size_t>(), end = off[1].get<size_t>();
    if (begin > end || end > data_size)
      fail(format("tensor '{}': data_offsets [{}, {}] outside the data ({} bytes; truncated file?)",
                  name, begin, end, data_size));
    if (end - begin != numel * dtype_size(e.dtype))
      fail(format("tensor '{}': {} bytes for shape {} of {} (expected {})", name, end - begin,
                  v["shape"].dump(), dt, numel * dtype_size(e.dtype)));
    e.data = data + begin;
    e.bytes = end - begin;
    entries_.push_back(e);
  }
  // Sorted by offset, tensors must tile the data exactly.
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& e : entries_) by_offset.push_back(&e);
  // By offset; an empty tensor sharing an offset goes first.
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
    return a->data != b->data ? a->data < b->data : a->bytes < b->bytes;
  });
  const char* expect = data;
  for (const auto* e : by_offset) {
    if (static_cast<const char*>(e->data) != expect)
      fail(format("tensor '{}': data_offsets overlap or leave a gap", e->name));
    expect += e->bytes;
  }
  if (expect != data + data_size)
    fail(format("{} trailing bytes after the last tensor", data + data_size - expect));
  unmap.armed = false;
}

void SafetensorsFile::drop(const void* p, size_t n) const {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, size_);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  for (const auto& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

}  // namespace loom
