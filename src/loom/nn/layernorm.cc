#include "loom/nn/layernorm.h"
#include "loom/nn/deferred_grads.h"

#include <type_traits>

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
  if constexpr (std::is_same_v<T, float>) {
    // Where only the next linear's GEMMs read the output (its bf16 record
    // twin), it goes straight there: never written in f32, never rounded again.
    const Input<T> home = ps.input(out, N * C_);
    if (home.r16 != nullptr) {
      be.layernorm_forward_16(home.r16, mean, rstd, x, ps.param(weight), ps.param(bias), N, C_,
                              DType::kBF16);
      ps.mark_written(out, N * C_);
      return;
    }
  }
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
