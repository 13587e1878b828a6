#include "loom/core/memory.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <utility>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "loom/core/error.h"

namespace loom {

std::string_view mem_category_name(MemCategory c) {
  static constexpr std::string_view kNames[kNumMemCategories] = {
      "params", "grads", "optimizer", "activations", "comm", "workspace"};
  return kNames[static_cast<int>(c)];
}

void MemoryTracker::on_alloc(MemCategory c, size_t bytes) {
  int i = static_cast<int>(c);
  size_t now = current_[i].fetch_add(bytes) + bytes;
  size_t peak = peak_[i].load();
  while (now > peak && !peak_[i].compare_exchange_weak(peak, now)) {
  }
}

void MemoryTracker::on_free(MemCategory c, size_t bytes) {
  current_[static_cast<int>(c)].fetch_sub(bytes);
}

MemStats MemoryTracker::stats() const {
  MemStats s;
  for (int i = 0; i < kNumMemCategories; ++i) {
    s.current[i] = current_[i].load();
    s.peak[i] = peak_[i].load();
  }
  return s;
}

void MemoryTracker::reset_peaks() {
  for (int i = 0; i < kNumMemCategories; ++i) peak_[i].store(current_[i].load());
}

MemoryTracker& memory_tracker() {
  static MemoryTracker tracker;
  return tracker;
}

bool host_allocator_tuned() {
  for (const char* v : {"MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"})
    if (std::getenv(v) != nullptr) return true;
  const char* t = std::getenv("GLIBC_TUNABLES");
  return t != nullptr && std::strstr(t, "glibc.malloc.") != nullptr;
}

bool keep_freed_host_memory() {
#if defined(__GLIBC__)
  if (host_allocator_tuned()) return false;
  // No block mapped on its own (every one comes from a heap and goes back
  // to it), and the heap trimmed only past 2 GiB free at its top.
  const bool no_mmap = mallopt(M_MMAP_MAX, 0) == 1;
  const bool no_trim = mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max()) == 1;
  return no_mmap || no_trim;
#else
  return false;
#endif
}

Buffer::Buffer(size_t bytes, MemCategory category, bool zeroed)
    : bytes_(bytes), category_(category) {
  if (bytes == 0) return;
  LOOM_CHECK(bytes <= size_t(PTRDIFF_MAX) / 2, "allocating {} bytes for {}: more than any host has",
             bytes, mem_category_name(category));
  const size_t rounded = (bytes + 63) / 64 * 64;
  base_ = std::malloc(rounded + 64);
  LOOM_CHECK(base_ != nullptr, "out of memory allocating {} bytes for {}", bytes,
             mem_category_name(category));
  const auto at = reinterpret_cast<uintptr_t>(base_);
  data_ = reinterpret_cast<void*>((at + 63) / 64 * 64);
  if (zeroed) std::memset(data_, 0, rounded);
  memory_tracker().on_alloc(category_, bytes_);
}

const char* device_name(Device d) {
  return d == Device::kCuda ? "cuda" : "cpu";
}

Buffer Buffer::adopt(void* data, size_t bytes, MemCategory category, Device device,
                     void (*free_fn)(void*)) {
  Buffer b;
  b.data_ = data;
  b.bytes_ = bytes;
  b.category_ = category;
  b.device_ = device;
  b.free_ = free_fn;
  if (free_fn == nullptr) b.base_ = data;  // std::free
  if (data != nullptr) memory_tracker().on_alloc(category, bytes);
  return b;
}

Buffer::~Buffer() {
  release();
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      category_(other.category_),
      device_(other.device_),
      free_(std::exchange(other.free_, nullptr)),
      base_(std::exchange(other.base_, nullptr)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    category_ = other.category_;
    device_ = other.device_;
    free_ = std::exchange(other.free_, nullptr);
    base_ = std::exchange(other.base_, nullptr);
  }
  return *this;
}

void Buffer::release() {
  if (data_ == nullptr) return;
  if (free_ != nullptr)
    free_(data_);
  else
    std::free(base_);
  memory_tracker().on_free(category_, bytes_);
  data_ = nullptr;
  base_ = nullptr;
  bytes_ = 0;
}

}  // namespace loom
