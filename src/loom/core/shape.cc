#include "loom/core/shape.h"

#include "loom/core/error.h"

namespace loom {

Shape::Shape(std::initializer_list<int64_t> dims) {
  LOOM_CHECK(dims.size() <= 4, "a shape has at most 4 dims, got {}", dims.size());
  for (int64_t d : dims) {
    LOOM_CHECK(d >= 0, "negative dimension {}", d);
    dims_[rank_++] = d;
  }
}

Shape::Shape(const std::vector<int64_t>& dims) {
  LOOM_CHECK(dims.size() <= 4, "a shape has at most 4 dims, got {}", dims.size());
  for (int64_t d : dims) {
    LOOM_CHECK(d >= 0, "negative dimension {}", d);
    dims_[rank_++] = d;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + ")";
}

}  // namespace loom
