#include "loom/core/tensor.h"

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

Tensor Tensor::empty(Shape shape, DType dtype, MemCategory category) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.owner_ =
      std::make_shared<Buffer>(static_cast<size_t>(shape.numel()) * dtype_size(dtype), category);
  t.data_ = t.owner_->data();
  return t;
}

Tensor Tensor::view(void* data, Shape shape, DType dtype) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.data_ = data;
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  LOOM_CHECK(shape.numel() == numel(), "reshape {} -> {} changes the element count", shape_.str(),
             shape.str());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  LOOM_CHECK(shape_.rank() >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
             "slice [{}, {}) out of range for {}", begin, end, shape_.str());
  int64_t row = shape_[0] == 0 ? 0 : numel() / shape_[0];
  Tensor t = *this;
  t.data_ = static_cast<char*>(data_) + begin * row * static_cast<int64_t>(dtype_size(dtype_));
  switch (shape_.rank()) {
    case 1:
      t.shape_ = Shape{end - begin};
      break;
    case 2:
      t.shape_ = Shape{end - begin, shape_[1]};
      break;
    case 3:
      t.shape_ = Shape{end - begin, shape_[1], shape_[2]};
      break;
    default:
      t.shape_ = Shape{end - begin, shape_[1], shape_[2], shape_[3]};
      break;
  }
  return t;
}

Tensor Tensor::to(DType dtype, MemCategory category) const {
  Tensor out = empty(shape_, dtype, category);
  convert(data_, dtype_, out.data_, dtype, static_cast<size_t>(numel()));
  return out;
}

}  // namespace loom
