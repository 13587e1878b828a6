#include "loom/nn/attention.h"

#include <cstring>

#include "loom/kernels/cpu/attention.h"
#include "loom/kernels/cpu/matmul.h"

namespace loom {

template <typename T>
Attention<T>::Attention(ParamLayout& layout, const std::string& prefix, const GptConfig& c,
                        float proj_std)
    : C_(c.n_embd), NH_(c.n_head) {
  const int64_t C = c.n_embd;
  c_attn_w = layout.add(prefix + ".c_attn.weight", {C, 3 * C}, true, ParamInit{kInitStd});
  c_attn_b = layout.add(prefix + ".c_attn.bias", {3 * C}, false, ParamInit{});
  c_proj_w = layout.add(prefix + ".c_proj.weight", {C, C}, true, ParamInit{proj_std});
  c_proj_b = layout.add(prefix + ".c_proj.bias", {C}, false, ParamInit{});
}

template <typename T>
typename Attention<T>::Record Attention<T>::bind(Arena<T>& record, Arena<T>& recompute, int64_t B,
                                                 int64_t Tn, bool selective) const {
  const int64_t BT = B * Tn;
  Record r{};
  r.qkv = record.take(BT * 3 * C_);
  Arena<T>& core = selective ? recompute : record;
  r.y = core.take(BT * C_);
  r.lse = core.take(B * NH_ * Tn);
  return r;
}

template <typename T>
int64_t Attention<T>::scratch_elems(int64_t B, int64_t Tn) const {
  return B * Tn * 4 * C_;
}

template <typename T>
void Attention<T>::forward(const ParamStore<T>& ps, const Record& r, T* out, const T* x, int64_t B,
                           int64_t Tn, const cpu::DropoutSpec& probs) const {
  const int64_t BT = B * Tn;
  cpu::matmul_forward(r.qkv, x, ps.param(c_attn_w), ps.param(c_attn_b), BT, C_, 3 * C_);
  cpu::attention_forward(r.y, r.lse, r.qkv, B, Tn, C_, NH_, probs);
  cpu::matmul_forward(out, r.y, ps.param(c_proj_w), ps.param(c_proj_b), BT, C_, C_);
}

template <typename T>
void Attention<T>::backward(const ParamStore<T>& ps, const Record& r, T* dx, const T* dout,
                            const T* x, int64_t B, int64_t Tn, const cpu::DropoutSpec& probs,
                            bool selective, T* scratch) const {
  const int64_t BT = B * Tn;
  Arena<T> a(scratch);
  T* d_y = a.take(BT * C_);
  T* d_qkv = a.take(BT * 3 * C_);
  // Selective: the core again from q|k|v, with the same dropout masks.
  if (selective) cpu::attention_forward(r.y, r.lse, r.qkv, B, Tn, C_, NH_, probs);
  const T *y = r.y, *lse = r.lse;
  zero(d_y, BT * C_);
  cpu::matmul_backward(d_y, ps.grad(c_proj_w), ps.grad(c_proj_b), dout, y, ps.param(c_proj_w), BT,
                       C_, C_);
  zero(d_qkv, BT * 3 * C_);
  cpu::attention_backward(d_qkv, d_y, r.qkv, y, lse, B, Tn, C_, NH_, probs);
  cpu::matmul_backward(dx, ps.grad(c_attn_w), ps.grad(c_attn_b), d_qkv, x, ps.param(c_attn_w), BT,
                       C_, 3 * C_);
}

template class Attention<float>;
template class Attention<double>;

}  // namespace loom
