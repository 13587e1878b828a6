#include "loom/nn/layernorm.h"
#include "loom/nn/deferred_grads.h"

namespace loom {

template <typename T>
LayerNorm<T>::LayerNorm(ParamLayout& layout, const std::string& prefix, int64_t C) : C_(C) {
  weight = layout.add(prefix + ".weight", {C}, false, ParamInit{0, 1});
  bias = layout.add(prefix + ".bias", {C}, false, ParamInit{0, 0});
}

template <typename T>
void LayerNorm<T>::forward(const ParamStore<T>& ps, T* out, T* mean, T* rstd, const T* x,
                           int64_t N) const {
  const auto& be = ps.backend();
  be.layernorm_forward(out, mean, rstd, x, ps.param(weight), ps.param(bias), N, C_);
}

template <typename T>
void LayerNorm<T>::backward(const ParamStore<T>& ps, T* dx, const T* dout, const T* x,
                            const T* mean, const T* rstd, int64_t N) const {
  layernorm_backward(ps, dx, weight, bias, dout, x, mean, rstd, N, C_);
}

template class LayerNorm<float>;
template class LayerNorm<double>;

}  // namespace loom
