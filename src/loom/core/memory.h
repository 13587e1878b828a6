// Memory accounting: every buffer loom allocates names a category, and the
// tracker keeps current and peak bytes per category (DESIGN.md, principle 5).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <string_view>

namespace loom {

enum class MemCategory : int { kParams, kGrads, kOptimizer, kActivations, kComm, kWorkspace };
inline constexpr int kNumMemCategories = 6;

std::string_view mem_category_name(MemCategory c);

struct MemStats {
  std::array<size_t, kNumMemCategories> current{};
  std::array<size_t, kNumMemCategories> peak{};
};

// Thread-safe counters. One tracker per process: it describes this process's
// address space, so it is the single place that can see every allocation.
class MemoryTracker {
 public:
  void on_alloc(MemCategory c, size_t bytes);
  void on_free(MemCategory c, size_t bytes);
  MemStats stats() const;
  // Peak := current for every category, so the next phase measures its own peak.
  void reset_peaks();

 private:
  std::array<std::atomic<size_t>, kNumMemCategories> current_{};
  std::array<std::atomic<size_t>, kNumMemCategories> peak_{};
};

MemoryTracker& memory_tracker();

// An owning, 64-byte aligned allocation counted under one category,
// zero-initialised unless the caller will write all of it first (zeroed =
// false). Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(size_t bytes, MemCategory category, bool zeroed = true);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_ = MemCategory::kWorkspace;
};

}  // namespace loom
