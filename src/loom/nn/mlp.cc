#include "loom/nn/mlp.h"
#include "loom/nn/deferred_grads.h"

#include <cstring>
#include <type_traits>

namespace loom {

template <typename T>
Mlp<T>::Mlp(ParamLayout& layout, const std::string& prefix, int64_t C, float proj_std) : C_(C) {
  c_fc_w = layout.add(prefix + ".c_fc.weight", {C, 4 * C}, true, ParamInit{kInitStd});
  c_fc_b = layout.add(prefix + ".c_fc.bias", {4 * C}, false, ParamInit{});
  c_proj_w = layout.add(prefix + ".c_proj.weight", {4 * C, C}, true, ParamInit{proj_std});
  c_proj_b = layout.add(prefix + ".c_proj.bias", {C}, false, ParamInit{});
}

template <typename T>
int64_t Mlp<T>::record_elems(const Rows& rows, bool selective) const {
  const int64_t BT = rows.count;
  return BT * 4 * C_ * (selective ? 1 : 2);
}

template <typename T>
int64_t Mlp<T>::recompute_elems(const Rows& rows, bool selective) const {
  const int64_t BT = rows.count;
  return selective ? BT * 4 * C_ : 0;
}

template <typename T>
int64_t Mlp<T>::scratch_elems(const Rows& rows) const {
  const int64_t BT = rows.count;
  return BT * 4 * C_ * 2;
}

template <typename T>
void Mlp<T>::forward(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
                     const Rows& rows, T* recompute) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.count;
  T* fch = record;
  T* fch_gelu = selective ? recompute : record + BT * 4 * C_;
  be.matmul_forward(fch, ps.input(x, BT * C_), ps.weight(c_fc_w), ps.param(c_fc_b), BT, C_, 4 * C_);
  // GELU records its input in its bf16 twin where the record keeps one, and
  // its output goes straight to its own twin where there is one (only
  // c_proj's GEMMs read it): never written in f32, never rounded again.
  Input<T> hidden = ps.input(fch_gelu, BT * 4 * C_);
  bool done = false;
  if constexpr (std::is_same_v<T, float>) {
    const Input<T> in = ps.input(fch, BT * 4 * C_);
    if (in.r16 != nullptr)
      be.gelu_forward_record_16(hidden.r16 != nullptr ? nullptr : fch_gelu, hidden.r16, fch, in.r16,
                                BT * 4 * C_, DType::kBF16);
    else if (hidden.r16 != nullptr)
      be.gelu_forward_16(hidden.r16, fch, BT * 4 * C_, DType::kBF16);
    done = in.r16 != nullptr || hidden.r16 != nullptr;
    hidden.written = hidden.r16 != nullptr;
  }
  if (!done) be.gelu_forward(fch_gelu, fch, BT * 4 * C_);
  if (out == nullptr) return;
  be.matmul_forward(out, hidden, ps.weight(c_proj_w), ps.param(c_proj_b), BT, 4 * C_, C_);
}

template <typename T>
void Mlp<T>::backward(const ParamStore<T>& ps, T* record, bool selective, T* dx, const T* dout,
                      const T* x, const Rows& rows, T* scratch, T* recompute) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.count;
  const T* fch = record;
  T* fch_gelu = selective ? recompute : record + BT * 4 * C_;
  // GELU is elementwise: recomputing it gives the forward's values exactly.
  if (selective) be.gelu_forward(fch_gelu, fch, BT * 4 * C_);
  // Both scratch gradients written over, never zero-filled first.
  T* d_fch = scratch;
  T* d_fch_gelu = scratch + BT * 4 * C_;
  linear_backward(ps, d_fch_gelu, c_proj_w, c_proj_b, dout, ps.input(fch_gelu, BT * 4 * C_), BT,
                  4 * C_, C_, GradWrite::kSet);
  // GELU's input from its bf16 twin where the record keeps one (unpack left it).
  bool done = false;
  if constexpr (std::is_same_v<T, float>) {
    const Input<T> in = ps.input(fch, BT * 4 * C_);
    if (in.r16 != nullptr)
      be.gelu_backward_16(d_fch, in.r16, d_fch_gelu, BT * 4 * C_, DType::kBF16);
    done = in.r16 != nullptr;
  }
  if (!done) be.gelu_backward(d_fch, fch, d_fch_gelu, BT * 4 * C_);
  linear_backward(ps, dx, c_fc_w, c_fc_b, d_fch, ps.input(x, BT * C_), BT, C_, 4 * C_,
                  GradWrite::kSet);
}

template class Mlp<float>;
template class Mlp<double>;

}  // namespace loom
