#include "loom/nn/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "loom/core/error.h"
#include "loom/kernels/cpu/attention.h"
#include "loom/kernels/cpu/cross_entropy.h"
#include "loom/kernels/cpu/elementwise.h"
#include "loom/kernels/cpu/encoder.h"
#include "loom/kernels/cpu/layernorm.h"
#include "loom/kernels/cpu/matmul.h"

namespace loom {

namespace {
constexpr float kInitStd = 0.02f;

template <typename T>
void zero(T* p, int64_t n) {
  std::memset(p, 0, static_cast<size_t>(n) * sizeof(T));
}
}  // namespace

template <typename T>
Gpt<T>::Gpt(const GptConfig& config, GptStorage storage)
    : config_(config), layout_(storage.unit_multiple) {
  const int64_t C = config.n_embd, Vp = config.padded_vocab();
  auto add = [&](const std::string& name, Shape shape, bool decay, float std, float value) {
    return layout_.add(name, shape, decay, std, value);
  };
  // Residual projections get std / sqrt(2 n_layer), as GPT-2 does, so the
  // residual stream's variance does not grow with depth.
  const float proj_std = kInitStd / std::sqrt(2.0f * static_cast<float>(config.n_layer));
  std::vector<size_t> idx;
  layout_.begin_unit("embeddings");
  idx.push_back(add("transformer.wte.weight", {Vp, C}, true, kInitStd, 0));
  idx.push_back(add("transformer.wpe.weight", {config.seq_len, C}, true, kInitStd, 0));
  for (int l = 0; l < config.n_layer; ++l) {
    std::string h = "transformer.h." + std::to_string(l) + ".";
    layout_.begin_unit("h." + std::to_string(l));
    idx.push_back(add(h + "ln_1.weight", {C}, false, 0, 1));
    idx.push_back(add(h + "ln_1.bias", {C}, false, 0, 0));
    idx.push_back(add(h + "attn.c_attn.weight", {C, 3 * C}, true, kInitStd, 0));
    idx.push_back(add(h + "attn.c_attn.bias", {3 * C}, false, 0, 0));
    idx.push_back(add(h + "attn.c_proj.weight", {C, C}, true, proj_std, 0));
    idx.push_back(add(h + "attn.c_proj.bias", {C}, false, 0, 0));
    idx.push_back(add(h + "ln_2.weight", {C}, false, 0, 1));
    idx.push_back(add(h + "ln_2.bias", {C}, false, 0, 0));
    idx.push_back(add(h + "mlp.c_fc.weight", {C, 4 * C}, true, kInitStd, 0));
    idx.push_back(add(h + "mlp.c_fc.bias", {4 * C}, false, 0, 0));
    idx.push_back(add(h + "mlp.c_proj.weight", {4 * C, C}, true, proj_std, 0));
    idx.push_back(add(h + "mlp.c_proj.bias", {C}, false, 0, 0));
  }
  layout_.begin_unit("ln_f");
  idx.push_back(add("transformer.ln_f.weight", {C}, false, 0, 1));
  idx.push_back(add("transformer.ln_f.bias", {C}, false, 0, 0));

  const auto& ps = layout_.params();
  size_t k = 0;
  wte_ = &ps[idx[k++]];
  wpe_ = &ps[idx[k++]];
  for (int l = 0; l < config.n_layer; ++l) {
    LayerParams p;
    for (const Param** slot : {&p.ln1_w, &p.ln1_b, &p.attn_w, &p.attn_b, &p.proj_w, &p.proj_b,
                               &p.ln2_w, &p.ln2_b, &p.fc_w, &p.fc_b, &p.fcproj_w, &p.fcproj_b})
      *slot = &ps[idx[k++]];
    lp_.push_back(p);
  }
  lnf_w_ = &ps[idx[k++]];
  lnf_b_ = &ps[idx[k++]];

  const size_t n_units = layout_.units().size();
  for (const Unit& u : layout_.units()) unit_begin_.push_back(u.begin);
  unit_params_.assign(n_units, nullptr);
  unit_grads_.assign(n_units, nullptr);
  const size_t bytes = static_cast<size_t>(layout_.total()) * sizeof(T);
  if (storage.params) allocate_params();
  if (storage.grads) {
    grads_ = Buffer(bytes, MemCategory::kGrads);
    for (size_t u = 0; u < n_units; ++u) unit_grads_[u] = grads() + unit_begin_[u];
  }
}

template <typename T>
void Gpt<T>::allocate_params() {
  if (!params_.data())
    params_ = Buffer(static_cast<size_t>(layout_.total()) * sizeof(T), MemCategory::kParams);
  for (size_t u = 0; u < unit_begin_.size(); ++u) unit_params_[u] = params() + unit_begin_[u];
}

template <typename T>
void Gpt<T>::release_params() {
  params_ = Buffer();
  unit_params_.assign(unit_params_.size(), nullptr);
}

template <typename T>
std::vector<UnitUse> Gpt<T>::unit_schedule(bool backward) const {
  const int L = config_.n_layer, emb = 0, lnf = L + 1;
  const Pass F = Pass::kForward, B = Pass::kBackward;
  std::vector<UnitUse> s{{emb, F}};
  for (int l = 0; l < L; ++l) s.push_back({unit_of_layer(l), F});
  s.push_back({lnf, F});
  s.push_back({emb, F});  // the tied LM head
  if (backward) {
    s.push_back({emb, B});
    s.push_back({lnf, B});
    for (int l = L - 1; l >= 0; --l) s.push_back({unit_of_layer(l), B});
    s.push_back({emb, Pass::kBackwardGradsOnly});  // the lookup's gradients
  }
  return s;
}

template <typename T>
void Gpt<T>::init(uint64_t seed) {
  LOOM_CHECK(params() != nullptr, "Gpt::init without a full parameter buffer");
  init_range(seed, 0, layout_.total(), params());
}

template <typename T>
void Gpt<T>::init_range(uint64_t seed, int64_t begin, int64_t end, T* dst) const {
  zero(dst, end - begin);
  const int64_t real_rows = config_.vocab_size;
  for (const Param& p : layout_.params()) {
    // The part of p inside [begin, end), as element indices of p.
    const int64_t lo = std::max<int64_t>(0, begin - p.offset);
    const int64_t hi = std::min<int64_t>(p.numel, end - p.offset);
    if (lo >= hi) continue;
    T* out = dst + (p.offset - begin);
    if (p.init_std == 0) {
      for (int64_t i = lo; i < hi; ++i) out[i] = T(p.init_value);
      continue;
    }
    NormalStream stream(seed, p.name);
    // Padded vocabulary rows of wte stay zero: they are never looked up and
    // their logits are excluded from the loss.
    const int64_t limit = std::min(hi, (&p == wte_) ? real_rows * p.shape[1] : p.numel);
#pragma omp parallel for
    for (int64_t i = lo; i < limit; ++i)
      out[i] = T(stream.at(static_cast<uint64_t>(i)) * p.init_std);
  }
}

template <typename T>
void Gpt<T>::zero_grads() {
  if (grads() != nullptr) zero(grads(), layout_.total());
}

template <typename T>
GptActivations<T> Gpt<T>::make_activations(int64_t B, int64_t Tn) const {
  LOOM_CHECK(Tn >= 1 && Tn <= config_.seq_len, "sequence length {} outside [1, {}]", Tn,
             config_.seq_len);
  const int64_t C = config_.n_embd, NH = config_.n_head, Vp = config_.padded_vocab();
  const int64_t BT = B * Tn;
  const int64_t per_layer = BT * C * 6 + BT * 3 * C + BT * 4 * C * 2 + BT * 4 + B * NH * Tn;
  const int64_t total = BT * C + config_.n_layer * per_layer + BT * C + BT * 2 + BT * Vp + BT * 2;
  GptActivations<T> a;
  a.B = B;
  a.Tn = Tn;
  a.buffer = Buffer(static_cast<size_t>(total) * sizeof(T), MemCategory::kActivations);
  T* p = a.buffer.template as<T>();
  auto take = [&p](int64_t n) {
    T* r = p;
    p += n;
    return r;
  };
  a.encoded = take(BT * C);
  a.layers.resize(static_cast<size_t>(config_.n_layer));
  for (auto& L : a.layers) {
    L.ln1 = take(BT * C), L.ln1_mean = take(BT), L.ln1_rstd = take(BT);
    L.qkv = take(BT * 3 * C), L.atty = take(BT * C), L.att_lse = take(B * NH * Tn);
    L.res2 = take(BT * C);
    L.ln2 = take(BT * C), L.ln2_mean = take(BT), L.ln2_rstd = take(BT);
    L.fch = take(BT * 4 * C), L.fch_gelu = take(BT * 4 * C);
    L.res3 = take(BT * C);
  }
  a.lnf = take(BT * C), a.lnf_mean = take(BT), a.lnf_rstd = take(BT);
  a.logits = take(BT * Vp);
  a.losses = take(BT), a.ce_lse = take(BT);
  LOOM_CHECK(p <= a.buffer.template as<T>() + total, "activation layout overflows its buffer");
  return a;
}

template <typename T>
void Gpt<T>::ensure_scratch(int64_t BT) {
  if (BT <= scratch_bt_) return;
  const int64_t C = config_.n_embd;
  scratch_ = Buffer(static_cast<size_t>(BT * C * 4 + BT * 3 * C + BT * 4 * C * 2) * sizeof(T),
                    MemCategory::kWorkspace);
  T* p = scratch_.as<T>();
  d_resid_ = p, p += BT * C;
  d_ln_ = p, p += BT * C;
  d_proj_ = p, p += BT * C;
  d_atty_ = p, p += BT * C;
  d_qkv_ = p, p += BT * 3 * C;
  d_fch_ = p, p += BT * 4 * C;
  d_fch_gelu_ = p;
  scratch_bt_ = BT;
}

template <typename T>
void Gpt<T>::block_forward(int l, GptActivations<T>& a, const T* x) {
  const int64_t B = a.B, Tn = a.Tn, BT = B * Tn, C = config_.n_embd, NH = config_.n_head;
  const LayerParams& p = lp_[l];
  auto& L = a.layers[l];
  DropoutStream stream(a.ctx.seed, a.ctx.step, a.ctx.training ? config_.dropout : 0.0f);
  auto spec = [&](DropoutSite s) {
    return cpu::DropoutSpec{&stream, a.ctx.sample0, dropout_site(l, s)};
  };

  cpu::layernorm_forward(L.ln1, L.ln1_mean, L.ln1_rstd, x, param(*p.ln1_w), param(*p.ln1_b), BT, C);
  cpu::matmul_forward(L.qkv, L.ln1, param(*p.attn_w), param(*p.attn_b), BT, C, 3 * C);
  cpu::attention_forward(L.atty, L.att_lse, L.qkv, B, Tn, C, NH, spec(DropoutSite::kAttnProbs));
  // res2 = x + dropout(atty @ W_proj + b)
  cpu::matmul_forward(L.res2, L.atty, param(*p.proj_w), param(*p.proj_b), BT, C, C);
  cpu::dropout_inplace(L.res2, spec(DropoutSite::kAttnResid), B, Tn, C);
  cpu::add_inplace(L.res2, x, BT * C);

  cpu::layernorm_forward(L.ln2, L.ln2_mean, L.ln2_rstd, L.res2, param(*p.ln2_w), param(*p.ln2_b),
                         BT, C);
  cpu::matmul_forward(L.fch, L.ln2, param(*p.fc_w), param(*p.fc_b), BT, C, 4 * C);
  cpu::gelu_forward(L.fch_gelu, L.fch, BT * 4 * C);
  // res3 = res2 + dropout(gelu(fch) @ W_fcproj + b)
  cpu::matmul_forward(L.res3, L.fch_gelu, param(*p.fcproj_w), param(*p.fcproj_b), BT, 4 * C, C);
  cpu::dropout_inplace(L.res3, spec(DropoutSite::kMlpResid), B, Tn, C);
  cpu::add_inplace(L.res3, L.res2, BT * C);
}

template <typename T>
void Gpt<T>::block_backward(int l, GptActivations<T>& a, const T* x, T* dresid) {
  const int64_t B = a.B, Tn = a.Tn, BT = B * Tn, C = config_.n_embd, NH = config_.n_head;
  const LayerParams& p = lp_[l];
  auto& L = a.layers[l];
  DropoutStream stream(a.ctx.seed, a.ctx.step, a.ctx.training ? config_.dropout : 0.0f);
  auto spec = [&](DropoutSite s) {
    return cpu::DropoutSpec{&stream, a.ctx.sample0, dropout_site(l, s)};
  };

  // MLP: dresid holds d(res3); the residual passes it through to d(res2).
  std::memcpy(d_proj_, dresid, static_cast<size_t>(BT * C) * sizeof(T));
  cpu::dropout_inplace(d_proj_, spec(DropoutSite::kMlpResid), B, Tn, C);
  zero(d_fch_gelu_, BT * 4 * C);
  cpu::matmul_backward(d_fch_gelu_, grad(*p.fcproj_w), grad(*p.fcproj_b), d_proj_, L.fch_gelu,
                       param(*p.fcproj_w), BT, 4 * C, C);
  zero(d_fch_, BT * 4 * C);
  cpu::gelu_backward(d_fch_, L.fch, d_fch_gelu_, BT * 4 * C);
  zero(d_ln_, BT * C);
  cpu::matmul_backward(d_ln_, grad(*p.fc_w), grad(*p.fc_b), d_fch_, L.ln2, param(*p.fc_w), BT, C,
                       4 * C);
  cpu::layernorm_backward(dresid, grad(*p.ln2_w), grad(*p.ln2_b), d_ln_, L.res2, param(*p.ln2_w),
                          L.ln2_mean, L.ln2_rstd, BT, C);

  // Attention: dresid now holds d(res2).
  std::memcpy(d_proj_, dresid, static_cast<size_t>(BT * C) * sizeof(T));
  cpu::dropout_inplace(d_proj_, spec(DropoutSite::kAttnResid), B, Tn, C);
  zero(d_atty_, BT * C);
  cpu::matmul_backward(d_atty_, grad(*p.proj_w), grad(*p.proj_b), d_proj_, L.atty, param(*p.proj_w),
                       BT, C, C);
  zero(d_qkv_, BT * 3 * C);
  cpu::attention_backward(d_qkv_, d_atty_, L.qkv, L.atty, L.att_lse, B, Tn, C, NH,
                          spec(DropoutSite::kAttnProbs));
  zero(d_ln_, BT * C);
  cpu::matmul_backward(d_ln_, grad(*p.attn_w), grad(*p.attn_b), d_qkv_, L.ln1, param(*p.attn_w), BT,
                       C, 3 * C);
  cpu::layernorm_backward(dresid, grad(*p.ln1_w), grad(*p.ln1_b), d_ln_, x, param(*p.ln1_w),
                          L.ln1_mean, L.ln1_rstd, BT, C);
}

template <typename T>
double Gpt<T>::forward(GptActivations<T>& a, const int32_t* tokens, const int32_t* targets,
                       const StepContext& ctx) {
  const int64_t B = a.B, Tn = a.Tn, BT = B * Tn, C = config_.n_embd;
  const int64_t V = config_.vocab_size, Vp = config_.padded_vocab();
  a.tokens = tokens;
  a.targets = targets;
  a.ctx = ctx;
  DropoutStream stream(ctx.seed, ctx.step, ctx.training ? config_.dropout : 0.0f);

  const int emb = 0, lnf = config_.n_layer + 1;
  before(emb, Pass::kForward);
  cpu::encoder_forward(a.encoded, tokens, param(*wte_), param(*wpe_), B, Tn, C);
  after(emb, Pass::kForward);
  cpu::dropout_inplace(
      a.encoded, cpu::DropoutSpec{&stream, ctx.sample0, dropout_site(-1, DropoutSite::kEmbedding)},
      B, Tn, C);
  const T* x = a.encoded;
  for (int l = 0; l < config_.n_layer; ++l) {
    before(unit_of_layer(l), Pass::kForward);
    block_forward(l, a, x);
    after(unit_of_layer(l), Pass::kForward);
    x = a.layers[l].res3;
  }
  before(lnf, Pass::kForward);
  cpu::layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, x, param(*lnf_w_), param(*lnf_b_), BT, C);
  after(lnf, Pass::kForward);
  before(emb, Pass::kForward);
  cpu::matmul_nt_forward(a.logits, a.lnf, param(*wte_), BT, C, Vp);
  after(emb, Pass::kForward);
  if (targets == nullptr) return 0.0;
  cpu::cross_entropy_forward(a.losses, a.ce_lse, a.logits, targets, BT, V, Vp);
  double sum = 0;
  for (int64_t i = 0; i < BT; ++i) sum += a.losses[i];
  return sum / static_cast<double>(BT);
}

template <typename T>
void Gpt<T>::backward(GptActivations<T>& a, double loss_scale) {
  LOOM_CHECK(a.targets != nullptr, "backward needs a forward pass with targets");
  const int64_t B = a.B, Tn = a.Tn, BT = B * Tn, C = config_.n_embd;
  const int64_t V = config_.vocab_size, Vp = config_.padded_vocab();
  ensure_scratch(BT);

  // d(mean loss)/d(loss_n) = 1 / BT, times the caller's scale (accumulation, loss scaling).
  std::vector<T> dloss(static_cast<size_t>(BT), T(loss_scale / static_cast<double>(BT)));
  cpu::cross_entropy_backward(a.logits, a.ce_lse, a.targets, dloss.data(), BT, V, Vp);
  const int emb = 0, lnf = config_.n_layer + 1;
  zero(d_ln_, BT * C);
  before(emb, Pass::kBackward);
  cpu::matmul_nt_backward(d_ln_, grad(*wte_), a.logits, a.lnf, param(*wte_), BT, C, Vp);
  after(emb, Pass::kBackward);
  zero(d_resid_, BT * C);
  const T* last = config_.n_layer > 0 ? a.layers.back().res3 : a.encoded;
  before(lnf, Pass::kBackward);
  cpu::layernorm_backward(d_resid_, grad(*lnf_w_), grad(*lnf_b_), d_ln_, last, param(*lnf_w_),
                          a.lnf_mean, a.lnf_rstd, BT, C);
  after(lnf, Pass::kBackward);
  for (int l = config_.n_layer - 1; l >= 0; --l) {
    const T* x = l > 0 ? a.layers[l - 1].res3 : a.encoded;
    before(unit_of_layer(l), Pass::kBackward);
    block_backward(l, a, x, d_resid_);
    after(unit_of_layer(l), Pass::kBackward);
  }
  DropoutStream stream(a.ctx.seed, a.ctx.step, a.ctx.training ? config_.dropout : 0.0f);
  cpu::dropout_inplace(
      d_resid_, cpu::DropoutSpec{&stream, a.ctx.sample0, dropout_site(-1, DropoutSite::kEmbedding)},
      B, Tn, C);
  before(emb, Pass::kBackwardGradsOnly);
  cpu::encoder_backward(grad(*wte_), grad(*wpe_), d_resid_, a.tokens, B, Tn, C);
  after(emb, Pass::kBackwardGradsOnly);
}

template <typename T>
KvCache<T> Gpt<T>::make_kv_cache() const {
  const size_t C = static_cast<size_t>(config_.n_embd), L = static_cast<size_t>(config_.n_layer);
  const size_t Tn = static_cast<size_t>(config_.seq_len);
  KvCache<T> c;
  c.k.resize(L * Tn * C), c.v.resize(L * Tn * C);
  c.x.resize(C), c.ln.resize(C), c.stat.resize(2), c.qkv.resize(3 * C), c.att.resize(C);
  c.fch.resize(4 * C), c.fch_gelu.resize(4 * C), c.out.resize(C), c.scores.resize(Tn);
  c.logits.resize(static_cast<size_t>(config_.padded_vocab()));
  return c;
}

template <typename T>
const T* Gpt<T>::decode_step(KvCache<T>& c, int32_t token) {
  const int64_t C = config_.n_embd, NH = config_.n_head, hs = C / NH, Tn = config_.seq_len;
  const int64_t pos = c.len;
  LOOM_CHECK(pos < Tn, "KV cache full: position {} of seq_len {}", pos, Tn);
  LOOM_CHECK(token >= 0 && token < config_.vocab_size, "token {} outside the vocabulary {}", token,
             config_.vocab_size);
  const T* wte = param(*wte_);
  const T* wpe = param(*wpe_);
  for (int64_t i = 0; i < C; ++i) c.x[i] = wte[token * C + i] + wpe[pos * C + i];
  for (int l = 0; l < config_.n_layer; ++l) {
    const LayerParams& p = lp_[l];
    T* K = c.k.data() + l * Tn * C;
    T* V = c.v.data() + l * Tn * C;
    cpu::layernorm_forward(c.ln.data(), &c.stat[0], &c.stat[1], c.x.data(), param(*p.ln1_w),
                           param(*p.ln1_b), 1, C);
    cpu::matmul_forward(c.qkv.data(), c.ln.data(), param(*p.attn_w), param(*p.attn_b), 1, C, 3 * C);
    std::copy(c.qkv.begin() + C, c.qkv.begin() + 2 * C, K + pos * C);
    std::copy(c.qkv.begin() + 2 * C, c.qkv.end(), V + pos * C);
    const T scale = T(1) / std::sqrt(T(hs));
    for (int64_t h = 0; h < NH; ++h) {
      const T* q = c.qkv.data() + h * hs;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j <= pos; ++j) {
        T dot = 0;
        for (int64_t d = 0; d < hs; ++d) dot += q[d] * K[j * C + h * hs + d];
        c.scores[j] = dot * scale;
        mx = std::max(mx, c.scores[j]);
      }
      T sum = 0;
      for (int64_t j = 0; j <= pos; ++j) sum += (c.scores[j] = std::exp(c.scores[j] - mx));
      T* y = c.att.data() + h * hs;
      std::fill(y, y + hs, T(0));
      for (int64_t j = 0; j <= pos; ++j)
        for (int64_t d = 0; d < hs; ++d) y[d] += c.scores[j] / sum * V[j * C + h * hs + d];
    }
    cpu::matmul_forward(c.out.data(), c.att.data(), param(*p.proj_w), param(*p.proj_b), 1, C, C);
    for (int64_t i = 0; i < C; ++i) c.x[i] += c.out[i];
    cpu::layernorm_forward(c.ln.data(), &c.stat[0], &c.stat[1], c.x.data(), param(*p.ln2_w),
                           param(*p.ln2_b), 1, C);
    cpu::matmul_forward(c.fch.data(), c.ln.data(), param(*p.fc_w), param(*p.fc_b), 1, C, 4 * C);
    cpu::gelu_forward(c.fch_gelu.data(), c.fch.data(), 4 * C);
    cpu::matmul_forward(c.out.data(), c.fch_gelu.data(), param(*p.fcproj_w), param(*p.fcproj_b), 1,
                        4 * C, C);
    for (int64_t i = 0; i < C; ++i) c.x[i] += c.out[i];
  }
  cpu::layernorm_forward(c.ln.data(), &c.stat[0], &c.stat[1], c.x.data(), param(*lnf_w_),
                         param(*lnf_b_), 1, C);
  cpu::matmul_nt_forward(c.logits.data(), c.ln.data(), wte, 1, C, config_.padded_vocab());
  c.len = pos + 1;
  return c.logits.data();
}

template <typename T>
double Gpt<T>::flops_per_token() const {
  // Padded vocabulary rows are real matmul work but not model parameters; the
  // formula counts parameters as a user would (unpadded).
  double params = 0;
  for (const Param& p : layout_.params()) params += static_cast<double>(p.numel);
  params -= static_cast<double>(config_.padded_vocab() - config_.vocab_size) * config_.n_embd;
  return 6.0 * params +
         12.0 * config_.n_layer * static_cast<double>(config_.seq_len) * config_.n_embd;
}

template class Gpt<float>;
template class Gpt<double>;

}  // namespace loom
