// Tensor: a contiguous array of up to 4 dimensions over a buffer it owns or
// views. Layers work on raw spans (STYLE.md); Tensor carries shape and dtype
// where a value crosses an interface (checkpoints, named parameter views).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/memory.h"

namespace loom {

enum class Device : uint8_t { kCpu };

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(const std::vector<int64_t>& dims);
  std::vector<int64_t> dims() const { return {dims_.begin(), dims_.begin() + rank_}; }
  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "(768, 2304)"

 private:
  std::array<int64_t, 4> dims_{};
  int rank_ = 0;
};

class Tensor {
 public:
  Tensor() = default;
  // Owning: allocates numel * dtype_size bytes, zeroed, under `category`.
  static Tensor empty(Shape shape, DType dtype, MemCategory category);
  // View: `data` must outlive the tensor.
  static Tensor view(void* data, Shape shape, DType dtype);

  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  Device device() const { return Device::kCpu; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool owning() const { return owner_ != nullptr; }

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  // The same memory with another shape of equal numel.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) of the first dimension, as a view.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // A new owning tensor with another dtype.
  Tensor to(DType dtype, MemCategory category) const;

 private:
  std::shared_ptr<Buffer> owner_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::kF32;
};

}  // namespace loom
