#include "loom/nn/param_store.h"

#include <algorithm>
#include <cstring>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/core/threads.h"

namespace loom {

template <typename T>
void ParamStore<T>::build(ParamLayout layout, StoreOptions options, const Backend<T>& backend) {
  backend_ = &backend;
  layout_ = std::move(layout);
  const size_t n_units = layout_.units().size();
  unit_params_.assign(n_units, nullptr);
  unit_grads_.assign(n_units, nullptr);
  unit_params16_.assign(n_units, nullptr);
  unit_widened_.assign(n_units, nullptr);
  params_ = Buffer();
  grads_ = Buffer();
  if (options.params) allocate_params();
  if (options.grads) {
    grads_ = backend_->alloc(static_cast<size_t>(layout_.total()) * sizeof(T), MemCategory::kGrads);
    for (size_t u = 0; u < n_units; ++u) unit_grads_[u] = grads() + begin(static_cast<int>(u));
  }
}

template <typename T>
void ParamStore<T>::allocate_params() {
  if (!params_.data())
    params_ =
        backend_->alloc(static_cast<size_t>(layout_.total()) * sizeof(T), MemCategory::kParams);
  for (size_t u = 0; u < unit_params_.size(); ++u)
    bind_params(static_cast<int>(u), params() + begin(static_cast<int>(u)));
}

template <typename T>
void ParamStore<T>::release_params() {
  params_ = Buffer();
  unit_params_.assign(unit_params_.size(), nullptr);
  unit_widened_.assign(unit_widened_.size(), nullptr);
}

template <typename T>
T* ParamStore<T>::widened_param(const Param& p) const {
  LOOM_CHECK(!p.matrix(),
             "'{}' is held in 16 bits alone while 16-bit GEMMs read it (kernels.gemm_inputs: "
             "16bit): a layer must read it through weight(), not param()",
             p.name);
  return unit_widened_[static_cast<size_t>(p.unit)] + p.widened;
}

template <typename T>
void ParamStore<T>::init(uint64_t seed) {
  LOOM_CHECK(params() != nullptr, "ParamStore::init without a full parameter buffer");
  init_range(seed, 0, layout_.total(), params());
}

template <typename T>
void ParamStore<T>::init_range(uint64_t seed, int64_t begin, int64_t end, T* dst) const {
  std::memset(dst, 0, static_cast<size_t>(end - begin) * sizeof(T));
  for (const Param& p : layout_.params()) {
    // The part of p inside [begin, end), as local element indices of p.
    const int64_t lo = std::max<int64_t>(0, begin - p.offset);
    const int64_t hi = std::min<int64_t>(p.numel, end - p.offset);
    if (lo >= hi) continue;
    T* out = dst + (p.offset - begin);
    if (p.init.std == 0) {
      for (int64_t i = lo; i < hi; ++i) out[i] = T(p.init.value);
      continue;
    }
    NormalStream stream(seed, p.name);
    // Elements are drawn by their global index, so a slice (tensor
    // parallelism) or a range (ZeRO) holds exactly the whole tensor's values.
    // Rows past valid_rows (vocabulary padding) stay zero: they are never
    // looked up and their logits are excluded from the loss.
    const int64_t row = p.shape.rank() > 1 ? p.shape.numel() / p.shape[0] : 1;
    const int64_t limit = p.init.valid_rows < 0 ? p.shape.numel() : p.init.valid_rows * row;
    const float std = p.init.std;
    host_parallel_for(hi - lo, [&](int64_t b, int64_t e) {
      for (int64_t i = lo + b; i < lo + e; ++i) {
        const int64_t g = shard_global_index(p.shape, p.shard, i);
        if (g < limit) out[i] = T(stream.at(static_cast<uint64_t>(g)) * std);
      }
    });
  }
}

template <typename T>
void ParamStore<T>::zero_grads() {
  if (grads() != nullptr) backend_->fill(grads(), layout_.total(), T(0));
}

template class ParamStore<float>;
template class ParamStore<double>;

}  // namespace loom
