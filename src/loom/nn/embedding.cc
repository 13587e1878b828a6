#include "loom/nn/embedding.h"
#include "loom/nn/deferred_grads.h"

#include "loom/core/error.h"

namespace loom {

template <typename T>
Embedding<T>::Embedding(ParamLayout& layout, const GptConfig& c)
    : C_(c.n_embd), V_(c.padded_vocab()) {
  wte_ = layout.add("transformer.wte.weight", {c.padded_vocab(), c.n_embd}, true,
                    ParamInit{kInitStd, 0, c.vocab_size});
  wpe_ = layout.add("transformer.wpe.weight", {c.seq_len, c.n_embd}, true, ParamInit{kInitStd});
}

template <typename T>
void Embedding<T>::forward(const ParamStore<T>& ps, T* out, const int32_t* tokens, const Rows& rows,
                           const Dropout& drop) const {
  const auto& be = ps.backend();
  LOOM_CHECK(!rows.split(), "the single-process embedding works on whole micro-batches");
  be.encoder_forward(out, tokens, ps.weight(wte_), ps.weight(wpe_), rows.B, rows.Tn, C_, rows.pos);
  drop.apply(be, out, -1, DropoutSite::kEmbedding, rows, C_);
}

template <typename T>
void Embedding<T>::backward(const ParamStore<T>& ps, T* dout, const int32_t* tokens,
                            const Rows& rows, const Dropout& drop) const {
  const auto& be = ps.backend();
  drop.apply(be, dout, -1, DropoutSite::kEmbedding, rows, C_);
  const int64_t B = rows.B, Tn = rows.Tn, C = C_, V = V_;
  const ParamId wte = wte_, wpe = wpe_;
  const int32_t* pos = rows.pos;  // the stage's, alive as long as the stage
  if (DeferredGrads<T>* d = ps.deferral()) {
    // The lookup's backward writes parameter gradients alone: all of it waits.
    const T* dy = d->keep(static_cast<const T*>(dout), B * Tn * C);
    const int32_t* tok = d->keep(tokens, B * Tn);
    d->add([=](const ParamStore<T>& s) {
      s.backend().encoder_backward(s.grad(wte), s.grad(wpe), dy, tok, B, Tn, C, 0, V, pos);
    });
    return;
  }
  be.encoder_backward(ps.grad(wte), ps.grad(wpe), dout, tokens, B, Tn, C, 0, V, pos);
}

template class Embedding<float>;
template class Embedding<double>;

}  // namespace loom
