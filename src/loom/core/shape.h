// Shape: the dimensions (up to 4) of a tensor. Tensors themselves are spans
// over Buffers (STYLE.md); Shape names a parameter's global and shard
// extents and a checkpoint tensor's.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace loom {

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

}  // namespace loom
