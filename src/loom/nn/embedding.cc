#include "loom/nn/embedding.h"

#include "loom/kernels/cpu/encoder.h"

namespace loom {

template <typename T>
Embedding<T>::Embedding(ParamLayout& layout, const GptConfig& c) : C_(c.n_embd) {
  wte_ = layout.add("transformer.wte.weight", {c.padded_vocab(), c.n_embd}, true,
                    ParamInit{kInitStd, 0, c.vocab_size});
  wpe_ = layout.add("transformer.wpe.weight", {c.seq_len, c.n_embd}, true, ParamInit{kInitStd});
}

template <typename T>
void Embedding<T>::forward(const ParamStore<T>& ps, T* out, const int32_t* tokens, int64_t B,
                           int64_t Tn, const Dropout& drop) const {
  cpu::encoder_forward(out, tokens, ps.param(wte_), ps.param(wpe_), B, Tn, C_);
  cpu::dropout_inplace(out, drop.at(-1, DropoutSite::kEmbedding), B, Tn, C_);
}

template <typename T>
void Embedding<T>::backward(const ParamStore<T>& ps, T* dout, const int32_t* tokens, int64_t B,
                            int64_t Tn, const Dropout& drop) const {
  cpu::dropout_inplace(dout, drop.at(-1, DropoutSite::kEmbedding), B, Tn, C_);
  cpu::encoder_backward(ps.grad(wte_), ps.grad(wpe_), dout, tokens, B, Tn, C_);
}

template class Embedding<float>;
template class Embedding<double>;

}  // namespace loom
