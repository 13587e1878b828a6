#include "loom/nn/deferred_grads.h"

#include <cstring>

#include "loom/core/error.h"

namespace loom {

template <typename T>
template <typename E>
const E* DeferredGrads<T>::keep(const E* src, int64_t n) {
  kept_.emplace_back(static_cast<size_t>(n) * sizeof(E), MemCategory::kActivations);
  std::memcpy(kept_.back().data(), src, static_cast<size_t>(n) * sizeof(E));
  return kept_.back().template as<E>();
}

template <typename T>
void DeferredGrads<T>::add(Work w) {
  LOOM_CHECK(unit_ >= 0, "deferred gradient work outside a unit");
  if (segments_.empty() || segments_.back().unit != unit_) segments_.push_back({unit_, {}});
  segments_.back().work.push_back(std::move(w));
}

template <typename T>
std::vector<int> DeferredGrads<T>::units() const {
  std::vector<int> u;
  for (const Segment& s : segments_) u.push_back(s.unit);
  return u;
}

template <typename T>
void DeferredGrads<T>::run(size_t k, const ParamStore<T>& ps) const {
  for (const Work& w : segments_.at(k).work) w(ps);
}

template <typename T>
void DeferredGrads<T>::clear() {
  segments_.clear();
  kept_.clear();
  unit_ = -1;
}

template <typename T>
void linear_backward(const ParamStore<T>& ps, T* dinp, ParamId w, ParamId b, const T* dout,
                     InputArg<T> inp, int64_t N, int64_t C, int64_t OC, GradWrite dinp_write) {
  const auto& be = ps.backend();
  DeferredGrads<T>* d = ps.deferral();
  if (!d) {
    be.matmul_backward(dinp, ps.grad(w), b.valid() ? ps.grad(b) : nullptr, dout, inp, ps.weight(w),
                       N, C, OC, dinp_write);
    return;
  }
  // A deferred product keeps its input's f32 values (the stage widens the
  // whole record for a backward that defers).
  LOOM_CHECK(inp.r16 == nullptr, "a deferred weight gradient's input has a bf16 twin");
  if (dinp)
    be.matmul_backward(dinp, nullptr, nullptr, dout, nullptr, ps.weight(w), N, C, OC, dinp_write);
  const T* dy = d->keep(dout, N * OC);
  const T* x = d->keep(inp.data, N * C);
  d->add([=](const ParamStore<T>& s) {
    s.backend().matmul_backward(nullptr, s.grad(w), b.valid() ? s.grad(b) : nullptr, dy, x, nullptr,
                                N, C, OC, GradWrite::kAdd);
  });
}

template <typename T>
void tied_head_backward(const ParamStore<T>& ps, T* dinp, ParamId wte, const T* dout, const T* inp,
                        int64_t N, int64_t C, int64_t V) {
  const auto& be = ps.backend();
  DeferredGrads<T>* d = ps.deferral();
  if (!d) {
    be.matmul_nt_backward(dinp, ps.grad(wte), dout, inp, ps.weight(wte), N, C, V);
    return;
  }
  be.matmul_nt_backward(dinp, nullptr, dout, nullptr, ps.weight(wte), N, C, V);
  const T* dy = d->keep(dout, N * V);
  const T* x = d->keep(inp, N * C);
  d->add([=](const ParamStore<T>& s) {
    s.backend().matmul_nt_backward(nullptr, s.grad(wte), dy, x, nullptr, N, C, V);
  });
}

template <typename T>
void layernorm_backward(const ParamStore<T>& ps, T* dx, ParamId w, ParamId b, const T* dout,
                        const T* x, const T* mean, const T* rstd, int64_t N, int64_t C,
                        const std::function<void(T*, int64_t)>& reduce) {
  const auto& be = ps.backend();
  // The parameter gradients: into the store's, or summed apart when they
  // still have to be added over the ranks splitting the rows.
  auto params = [=](const ParamStore<T>& s, const T* dy, const T* xs, const T* mu, const T* rs) {
    const Backend<T>& sb = s.backend();
    if (!reduce) {
      sb.layernorm_backward(nullptr, s.grad(w), s.grad(b), dy, xs, nullptr, mu, rs, N, C);
      return;
    }
    std::vector<T> part(static_cast<size_t>(2 * C), T(0));
    sb.layernorm_backward(nullptr, part.data(), part.data() + C, dy, xs, nullptr, mu, rs, N, C);
    reduce(part.data(), 2 * C);
    sb.add(s.grad(w), part.data(), C);
    sb.add(s.grad(b), part.data() + C, C);
  };
  DeferredGrads<T>* d = ps.deferral();
  if (!d && !reduce) {
    be.layernorm_backward(dx, ps.grad(w), ps.grad(b), dout, x, ps.param(w), mean, rstd, N, C);
    return;
  }
  be.layernorm_backward(dx, nullptr, nullptr, dout, x, ps.param(w), mean, rstd, N, C);
  if (!d) {
    params(ps, dout, x, mean, rstd);
    return;
  }
  const T* dy = d->keep(dout, N * C);
  const T* xs = d->keep(x, N * C);
  const T* mu = d->keep(mean, N);
  const T* rs = d->keep(rstd, N);
  d->add([=](const ParamStore<T>& s) { params(s, dy, xs, mu, rs); });
}

#define LOOM_INSTANTIATE(T)                                                                  \
  template class DeferredGrads<T>;                                                           \
  template const T* DeferredGrads<T>::keep<T>(const T*, int64_t);                            \
  template const int32_t* DeferredGrads<T>::keep<int32_t>(const int32_t*, int64_t);          \
  template void linear_backward<T>(const ParamStore<T>&, T*, ParamId, ParamId, const T*,     \
                                   InputArg<T>, int64_t, int64_t, int64_t, GradWrite);       \
  template void tied_head_backward<T>(const ParamStore<T>&, T*, ParamId, const T*, const T*, \
                                      int64_t, int64_t, int64_t);                            \
  template void layernorm_backward<T>(const ParamStore<T>&, T*, ParamId, ParamId, const T*,  \
                                      const T*, const T*, const T*, int64_t, int64_t,        \
                                      const std::function<void(T*, int64_t)>&);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom
