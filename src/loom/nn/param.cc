#include "loom/nn/param.h"

#include "loom/core/error.h"

namespace loom {

std::string ShardSpec::describe() const {
  switch (kind) {
    case kWhole:
      return "whole";
    case kDim:
      return format("dim {} piece {}/{}", dim, index, count);
    case kHeads:
      return format("heads of {} blocks along dim {} piece {}/{}", blocks, dim, index, count);
    case kVocab:
      return format("vocabulary range {}/{}", index, count);
  }
  return "?";
}

namespace {

// The split dimension's global extent, and the extent of one piece of it.
void check_spec(const Shape& g, const ShardSpec& s) {
  LOOM_CHECK(s.count >= 1 && s.index >= 0 && s.index < s.count, "shard {} of {} is invalid",
             s.index, s.count);
  if (s.kind == ShardSpec::kWhole) return;
  LOOM_CHECK(s.dim >= 0 && s.dim < g.rank(), "shard dimension {} outside shape {}", s.dim, g.str());
  const int64_t n = g[s.dim];
  const int64_t parts = s.kind == ShardSpec::kHeads ? int64_t{s.blocks} * s.count : s.count;
  LOOM_CHECK(n % parts == 0, "dimension {} of {} ({}) does not split into {} ({})", s.dim, g.str(),
             n, parts, s.describe());
}

// Row-major strides of the split dimension: outer (elements before it), n
// (its extent), inner (elements after it).
struct Strides {
  int64_t outer = 1, n = 1, inner = 1;
};

Strides strides(const Shape& g, int dim) {
  Strides st;
  for (int d = 0; d < dim; ++d) st.outer *= g[d];
  st.n = g[dim];
  for (int d = dim + 1; d < g.rank(); ++d) st.inner *= g[d];
  return st;
}

// The global coordinate along the split dimension of local coordinate j.
int64_t global_coord(const ShardSpec& s, int64_t n, int64_t j) {
  if (s.kind == ShardSpec::kHeads) {
    const int64_t block = n / s.blocks, piece = block / s.count;
    return (j / piece) * block + s.index * piece + j % piece;
  }
  return s.index * (n / s.count) + j;
}

}  // namespace

Shape shard_shape(const Shape& g, const ShardSpec& s) {
  check_spec(g, s);
  if (s.kind == ShardSpec::kWhole || s.count == 1) return g;
  int64_t d[4] = {0, 0, 0, 0};
  for (int i = 0; i < g.rank(); ++i) d[i] = g[i];
  d[s.dim] /= s.count;
  switch (g.rank()) {
    case 1:
      return Shape({d[0]});
    case 2:
      return Shape({d[0], d[1]});
    case 3:
      return Shape({d[0], d[1], d[2]});
    default:
      return Shape({d[0], d[1], d[2], d[3]});
  }
}

int64_t shard_global_index(const Shape& g, const ShardSpec& s, int64_t i) {
  if (s.kind == ShardSpec::kWhole || s.count == 1) return i;
  const Strides st = strides(g, s.dim);
  const int64_t local_n = st.n / s.count;
  const int64_t in = i % st.inner, j = (i / st.inner) % local_n, out = i / (st.inner * local_n);
  return (out * st.n + global_coord(s, st.n, j)) * st.inner + in;
}

template <typename T>
void shard_to_global(const Shape& g, const ShardSpec& s, const T* local, T* whole) {
  const int64_t n = shard_shape(g, s).numel();
  for (int64_t i = 0; i < n; ++i) whole[shard_global_index(g, s, i)] = local[i];
}

template <typename T>
void shard_from_global(const Shape& g, const ShardSpec& s, const T* whole, T* local) {
  const int64_t n = shard_shape(g, s).numel();
  for (int64_t i = 0; i < n; ++i) local[i] = whole[shard_global_index(g, s, i)];
}

template void shard_to_global<float>(const Shape&, const ShardSpec&, const float*, float*);
template void shard_to_global<double>(const Shape&, const ShardSpec&, const double*, double*);
template void shard_from_global<float>(const Shape&, const ShardSpec&, const float*, float*);
template void shard_from_global<double>(const Shape&, const ShardSpec&, const double*, double*);

int ParamLayout::begin_unit(std::string name) {
  // A unit starts after the previous one's padding.
  next_ = total_;
  units_.push_back({std::move(name), next_, next_});
  return static_cast<int>(units_.size()) - 1;
}

int ParamLayout::begin_expert_unit(std::string name) {
  LOOM_CHECK(!units_.empty() && !units_.back().expert(),
             "expert unit '{}' opened without a dense unit to ride on", name);
  const int host = static_cast<int>(units_.size()) - 1;
  const int u = begin_unit(std::move(name));
  units_.back().host = host;
  return u;
}

ParamId ParamLayout::add(std::string name, Shape shape, bool decay, ParamInit init,
                         ShardSpec shard) {
  LOOM_CHECK(!units_.empty(), "parameter '{}' added before any unit", name);
  LOOM_CHECK(find_or_null(name) == nullptr, "parameter '{}' declared twice", name);
  Param p;
  p.unit = static_cast<int>(units_.size()) - 1;
  p.name = std::move(name);
  p.shape = shape;
  p.shard = shard;
  p.local = shard_shape(shape, shard);
  p.offset = next_;
  p.numel = p.local.numel();
  p.decay = decay;
  p.init = init;
  // Keep every parameter 16-element aligned in the flat buffer (64 bytes in
  // f32), so each view starts on a cache line.
  next_ += (p.numel + 15) / 16 * 16;
  // The open unit ends padded to unit_multiple_.
  Unit& u = units_.back();
  if (!p.matrix()) {
    p.widened = u.widened;
    u.widened += (p.numel + 15) / 16 * 16;
  }
  u.end = u.begin + (next_ - u.begin + unit_multiple_ - 1) / unit_multiple_ * unit_multiple_;
  total_ = u.end;
  params_.push_back(std::move(p));
  return ParamId{static_cast<int>(params_.size()) - 1};
}

void ParamLayout::reserve(int64_t n) {
  LOOM_CHECK(!units_.empty() && n >= 0, "reserve({}) outside a unit", n);
  next_ += (n + 15) / 16 * 16;
  Unit& u = units_.back();
  u.end = u.begin + (next_ - u.begin + unit_multiple_ - 1) / unit_multiple_ * unit_multiple_;
  total_ = u.end;
}

int64_t ParamLayout::numel() const {
  int64_t n = 0;
  for (const Param& p : params_) n += p.numel;
  return n;
}

int ParamLayout::unit_index(const std::string& name) const {
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u].name == name) return static_cast<int>(u);
  return -1;
}

const Param* ParamLayout::find_or_null(const std::string& name) const {
  for (const Param& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

const Param& ParamLayout::find(const std::string& name) const {
  const Param* p = find_or_null(name);
  LOOM_CHECK(p != nullptr, "no parameter named '{}'", name);
  return *p;
}

}  // namespace loom
