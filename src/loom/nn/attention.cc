#include "loom/nn/attention.h"
#include "loom/nn/deferred_grads.h"

namespace loom {

template <typename T>
Attention<T>::Attention(ParamLayout& layout, const std::string& prefix, const GptConfig& c,
                        float proj_std, std::shared_ptr<const AttentionCore<T>> core)
    : C_(c.n_embd), NH_(c.n_head), core_(std::move(core)) {
  const int64_t C = c.n_embd;
  c_attn_w = layout.add(prefix + ".c_attn.weight", {C, 3 * C}, true, ParamInit{kInitStd});
  c_attn_b = layout.add(prefix + ".c_attn.bias", {3 * C}, false, ParamInit{});
  c_proj_w = layout.add(prefix + ".c_proj.weight", {C, C}, true, ParamInit{proj_std});
  c_proj_b = layout.add(prefix + ".c_proj.bias", {C}, false, ParamInit{});
}

template <typename T>
typename Attention<T>::Record Attention<T>::bind(T* record, T* recompute, int64_t B, int64_t Tn,
                                                 bool selective) const {
  const int64_t BT = B * Tn;
  Arena<T> rec(record), room(recompute);
  Record r{};
  r.qkv = rec.take(BT * 3 * C_);
  Arena<T>& core = selective ? room : rec;
  r.y = core.take(BT * C_);
  r.lse = core.take(B * NH_ * Tn);
  return r;
}

template <typename T>
int64_t Attention<T>::record_elems(const Rows& rows, bool selective) const {
  const int64_t B = rows.B, Tn = rows.Tn;
  return B * Tn * 3 * C_ + (selective ? 0 : B * Tn * C_ + B * NH_ * Tn);
}

template <typename T>
int64_t Attention<T>::recompute_elems(const Rows& rows, bool selective) const {
  const int64_t B = rows.B, Tn = rows.Tn;
  return selective ? B * Tn * C_ + B * NH_ * Tn : 0;
}

template <typename T>
std::vector<RecordRange> Attention<T>::exact_ranges(const Rows& rows, bool selective) const {
  // Backward recomputes the probabilities as exp(score - lse): a rounded
  // lse would scale every probability of its row.
  const int64_t BT = rows.B * rows.Tn;
  if (selective) return {};
  return {{BT * 4 * C_, rows.B * NH_ * rows.Tn}};
}

template <typename T>
std::vector<RecordRange> Attention<T>::twin_ranges(const Rows& rows, bool selective,
                                                   bool /*linears16*/) const {
  // q|k|v, read by the core alone: its 16-bit forms whatever the GEMMs read.
  if (selective || core_ != nullptr) return {};
  return {{0, rows.B * rows.Tn * 3 * C_}};
}

template <typename T>
std::vector<RecordRange> Attention<T>::shared_twin_ranges(const Rows& rows, bool selective) const {
  const int64_t BT = rows.B * rows.Tn;
  if (selective) return {};  // y is in the recompute room
  return {{BT * 3 * C_, BT * C_}};
}

template <typename T>
int64_t Attention<T>::scratch_elems(const Rows& rows) const {
  const int64_t B = rows.B, Tn = rows.Tn;
  return B * Tn * 4 * C_;
}

template <typename T>
void Attention<T>::forward(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
                           const Rows& rows, const DropoutSpec& probs, T* recompute) const {
  const auto& be = ps.backend();
  const int64_t B = rows.B, Tn = rows.Tn;
  const int64_t BT = B * Tn;
  const Record r = bind(record, recompute, B, Tn, selective);
  be.matmul_forward(r.qkv, ps.input(x, BT * C_), ps.weight(c_attn_w), ps.param(c_attn_b), BT, C_,
                    3 * C_);
  // q|k|v's twin: the core rounds them into the record as it reads them.
  const Input<T> qkv = ps.input(r.qkv, BT * 3 * C_);
  if constexpr (std::is_same_v<T, float>) {
    if (qkv.r16 != nullptr)
      be.attention_forward_16(r.y, r.lse, r.qkv, qkv.r16, B, Tn, C_, NH_, probs);
  }
  if (qkv.r16 == nullptr)
    attention_core_forward(core_.get(), be, r.y, r.lse, r.qkv, B, Tn, C_, NH_, probs);
  be.matmul_forward(out, ps.input(r.y, BT * C_), ps.weight(c_proj_w), ps.param(c_proj_b), BT, C_,
                    C_);
}

template <typename T>
void Attention<T>::backward(const ParamStore<T>& ps, T* record, bool selective, T* dx,
                            const T* dout, const T* x, const Rows& rows, const DropoutSpec& probs,
                            T* scratch, T* recompute) const {
  const auto& be = ps.backend();
  const int64_t B = rows.B, Tn = rows.Tn;
  const int64_t BT = B * Tn;
  const Record r = bind(record, recompute, B, Tn, selective);
  T* d_y = scratch;
  T* d_qkv = scratch + BT * C_;
  // Selective: the core again from q|k|v, with the same dropout masks.
  if (selective) attention_core_forward(core_.get(), be, r.y, r.lse, r.qkv, B, Tn, C_, NH_, probs);
  linear_backward(ps, d_y, c_proj_w, c_proj_b, dout, ps.input(r.y, BT * C_), BT, C_, C_,
                  GradWrite::kSet);
  // q|k|v's twin: read in bf16 where the record keeps them (unpack left them).
  const Input<T> qkv = ps.input(r.qkv, BT * 3 * C_);
  if constexpr (std::is_same_v<T, float>) {
    if (qkv.r16 != nullptr)
      be.attention_backward_16(d_qkv, d_y, qkv.r16, r.y, r.lse, B, Tn, C_, NH_, probs);
  }
  if (qkv.r16 == nullptr)
    attention_core_backward(core_.get(), be, d_qkv, d_y, r.qkv, r.y, r.lse, B, Tn, C_, NH_, probs);
  linear_backward(ps, dx, c_attn_w, c_attn_b, d_qkv, ps.input(x, BT * C_), BT, C_, 3 * C_,
                  GradWrite::kSet);
}

template class Attention<float>;
template class Attention<double>;

}  // namespace loom
