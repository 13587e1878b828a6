// Memory accounting: every buffer loom allocates names a category, and the
// tracker keeps current and peak bytes per category (DESIGN.md, principle 5).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

enum class MemCategory : int { kParams, kGrads, kOptimizer, kActivations, kComm, kWorkspace };
// Where an allocation lives: host memory, or a CUDA device's (a backend's
// own allocations, kernels/backend.h).
enum class Device : uint8_t { kCpu, kCuda };
const char* device_name(Device d);  // "cpu", "cuda"
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

// Makes the C library keep the host memory that is freed for the next
// allocations instead of handing it back to the system: a training step
// frees and allocates the same buffers over and over (a unit's f32 working
// copy and gradients, once per use in 16-bit mode), and memory handed back
// is faulted in again page by page, zeroed by the kernel, at every use.
// glibc: by default every block past its mmap threshold (128 KiB, rising
// adaptively to at most 32 MiB) gets a mapping of its own, unmapped when
// freed, and the heap is trimmed when a few times that threshold is free
// at its top. After this call the main arena (where the main thread, which
// runs the steps, allocates) maps no block on its own and is trimmed only
// past 2 GiB free, so a freed block is reused by the next allocation that
// fits and the process's resident size stays near its peak. Other threads'
// arenas still map blocks larger than their 64 MiB heaps on their own.
// Leaves the allocator alone where the user tuned it (host_allocator_tuned)
// or where the C library is not glibc (or a sanitizer's allocator stands in
// for it). Returns whether it changed anything. The command-line tool and
// the MPI test runner call it first thing.
bool keep_freed_host_memory();
// Whether the environment tunes glibc's allocator: MALLOC_MMAP_MAX_,
// MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, or glibc.malloc.* in
// GLIBC_TUNABLES.
bool host_allocator_tuned();

// An owning allocation counted under one category, with the device it lives
// on. The constructor allocates host memory, 64-byte aligned, zeroed unless
// the caller will write all of it first (zeroed = false); a backend with
// memory of its own hands its allocations over with adopt(). Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(size_t bytes, MemCategory category, bool zeroed = true);
  // Takes ownership of `data` (bytes, on `device`), freed by `free_fn`.
  static Buffer adopt(void* data, size_t bytes, MemCategory category, Device device,
                      void (*free_fn)(void*));
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  Device device() const { return device_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemCategory category_ = MemCategory::kWorkspace;
  Device device_ = Device::kCpu;
  void (*free_)(void*) = nullptr;  // null: std::free(base_)
  // Host allocations: what malloc returned, 64 bytes or less below data_.
  // (Not aligned_alloc: glibc's aligned blocks fragment its heap, so that
  // freed ones are not reused whole; malloc's are.)
  void* base_ = nullptr;
};

}  // namespace loom
