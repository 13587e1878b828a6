#include "loom/nn/head.h"
#include "loom/nn/deferred_grads.h"

#include <type_traits>

namespace loom {

template <typename T>
ParamId Head<T>::declare_wte(ParamLayout& layout) {
  // The same name, shape and initialisation as the embedding's: the copies
  // start equal and their gradients are summed across the embedding group.
  this->wte_ = layout.add("transformer.wte.weight", {c_.padded_vocab(), c_.n_embd}, true,
                          ParamInit{kInitStd, 0, c_.vocab_size});
  return this->wte_;
}

template <typename T>
HeadRecord<T> Head<T>::bind(Arena<T>& rec, Arena<T>& room, const Rows& rows,
                            bool recompute_logits) const {
  const int64_t BT = rows.all(), C = c_.n_embd, Vp = c_.padded_vocab();
  HeadRecord<T> r{};
  r.lnf = rec.take(BT * C), r.lnf_mean = rec.take(BT), r.lnf_rstd = rec.take(BT);
  r.lnf_all = r.lnf;
  r.logits = (recompute_logits ? room : rec).take(BT * Vp);
  r.losses = rec.take(BT), r.lse = rec.take(BT);
  return r;
}

template <typename T>
void Head<T>::logits_forward(const ParamStore<T>& ps, const HeadRecord<T>& r,
                             const Rows& rows) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.all();
  be.matmul_nt_forward(r.logits, r.lnf, ps.weight(this->wte_), BT, c_.n_embd, c_.padded_vocab());
}

template <typename T>
double Head<T>::loss(const ParamStore<T>& ps, const HeadRecord<T>& r, const int32_t* targets,
                     const Rows& rows) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.all();
  be.cross_entropy_forward(r.losses, r.lse, r.logits, targets, BT, c_.vocab_size,
                           c_.padded_vocab());
  double sum = 0;
  for (int64_t i = 0; i < BT; ++i) sum += r.losses[i];
  return sum;
}

template <typename T>
void Head<T>::logits_backward(const ParamStore<T>& ps, const HeadRecord<T>& r,
                              const int32_t* targets, const T* dloss, T* d_lnf,
                              const Rows& rows) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.all(), Vp = c_.padded_vocab();
  if constexpr (std::is_same_v<T, float>) {
    // GEMMs that read bf16 operands: the gradient written straight into
    // bf16, which both products multiply (bit for bit the f32 gradient they
    // would have rounded), never stored in f32 and read back. A deferred
    // weight gradient keeps the f32 one.
    const Weight<T> w = ps.weight(this->wte_);
    if (be.reads_inputs16() && ps.deferral() == nullptr &&
        (w.w16 == nullptr || w.t == DType::kBF16)) {
      Buffer d16 =
          be.alloc(static_cast<size_t>(BT * Vp) * sizeof(uint16_t), MemCategory::kWorkspace, false);
      be.cross_entropy_backward_16(d16.as<uint16_t>(), r.logits, r.lse, targets, dloss, BT,
                                   c_.vocab_size, Vp, 0, DType::kBF16);
      Input<T> dout(nullptr, d16.as<uint16_t>());
      dout.written = true;
      be.matmul_nt_backward(d_lnf, ps.grad(this->wte_), dout, r.lnf, w, BT, c_.n_embd, Vp);
      return;
    }
  }
  be.cross_entropy_backward(r.logits, r.lse, targets, dloss, BT, c_.vocab_size, Vp, 0);
  tied_head_backward(ps, d_lnf, this->wte_, r.logits, r.lnf, BT, c_.n_embd, Vp);
}

template class Head<float>;
template class Head<double>;

}  // namespace loom
