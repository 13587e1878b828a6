#include "loom/parallel/tensor/parallel_layers.h"

#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom::tp {

ParallelAttention::ParallelAttention(ParamLayout& layout, const std::string& prefix,
                                     const GptConfig& c, float proj_std, const Group& g,
                                     std::shared_ptr<const AttentionCore<float>> core)
    : g_(g),
      C_(c.n_embd),
      Cl_(c.n_embd / g.size()),
      NHl_(c.n_head / g.size()),
      c_attn_(layout, prefix + ".c_attn", c.n_embd, 3 * int64_t{c.n_embd}, kInitStd, g, 3),
      c_proj_(layout, prefix + ".c_proj", c.n_embd, c.n_embd, proj_std, g),
      core_(std::move(core)) {
  LOOM_CHECK_KIND(kConfig, c.n_head % g.size() == 0,
                  "model.n_head {} is not divisible by parallel.tensor {}", c.n_head, g.size());
}

ParallelAttention::Record ParallelAttention::bind(float* record, float* recompute, int64_t B,
                                                  int64_t Tn, bool selective) const {
  Arena<float> rec(record), room(recompute);
  Record r{};
  r.qkv = rec.take(B * Tn * 3 * Cl_);
  Arena<float>& core = selective ? room : rec;
  r.y = core.take(B * Tn * Cl_);
  r.lse = core.take(B * NHl_ * Tn);
  return r;
}

int64_t ParallelAttention::record_elems(const Rows& rows, bool selective) const {
  const int64_t B = rows.B, Tn = rows.Tn;
  return B * Tn * 3 * Cl_ + (selective ? 0 : B * Tn * Cl_ + B * NHl_ * Tn);
}

int64_t ParallelAttention::recompute_elems(const Rows& rows, bool selective) const {
  return selective ? rows.all() * Cl_ + rows.B * NHl_ * rows.Tn : 0;
}

std::vector<RecordRange> ParallelAttention::exact_ranges(const Rows& rows, bool selective) const {
  // The log-sum-exp, as in one process.
  const int64_t BT = rows.B * rows.Tn;
  if (selective) return {};
  return {{BT * 4 * Cl_, rows.B * NHl_ * rows.Tn}};
}

int64_t ParallelAttention::scratch_elems(const Rows& rows) const {
  // d_y (B,T,C/tp), d_qkv (B,T,3C/tp), the input gradient's partial sum
  // (B,T,C); with the sequence split, also the gathered input and output
  // gradient (B,T,C) each.
  const int64_t BT = rows.all();
  return BT * (4 * Cl_ + C_) + (rows.split() ? 2 * BT * C_ : 0);
}

DropoutSpec ParallelAttention::local_heads(DropoutSpec probs) const {
  probs.site += static_cast<uint32_t>(g_.rank() * NHl_);  // this rank's first global head
  return probs;
}

void ParallelAttention::forward(const ParamStore<float>& ps, float* record, bool selective,
                                float* out, const float* x, const Rows& rows,
                                const DropoutSpec& probs, float* recompute) const {
  const auto& be = ps.backend();
  const int64_t B = rows.B, Tn = rows.Tn, BT = rows.all();
  const Record r = bind(record, recompute, B, Tn, selective);
  Buffer all;  // sequence parallelism: the gathered input, then the partial output
  if (rows.split()) {
    all = be.alloc(static_cast<size_t>(BT * C_) * sizeof(float), MemCategory::kWorkspace);
    g_.gather(x, all.as<float>(), rows.count * C_);
    x = all.as<float>();
  }
  c_attn_.forward(ps, r.qkv, x, BT);
  attention_core_forward(core_.get(), be, r.y, r.lse, r.qkv, B, Tn, Cl_, NHl_, local_heads(probs));
  if (rows.split())
    c_proj_.forward_rows(ps, out, r.y, BT, all.as<float>());
  else
    c_proj_.forward(ps, out, r.y, BT);
}

void ParallelAttention::backward(const ParamStore<float>& ps, float* record, bool selective,
                                 float* dx, const float* dout, const float* x, const Rows& rows,
                                 const DropoutSpec& probs, float* scratch, float* recompute) const {
  const auto& be = ps.backend();
  const int64_t B = rows.B, Tn = rows.Tn, BT = rows.all();
  const Record r = bind(record, recompute, B, Tn, selective);
  Arena<float> a(scratch);
  float* d_y = a.take(BT * Cl_);
  float* d_qkv = a.take(BT * 3 * Cl_);
  float* d_x = a.take(BT * C_);
  gather_for_backward(g_, rows, C_, dout, x, a);
  if (selective)
    attention_core_forward(core_.get(), be, r.y, r.lse, r.qkv, B, Tn, Cl_, NHl_,
                           local_heads(probs));
  c_proj_.backward(ps, d_y, dout, r.y, BT, GradWrite::kSet);
  attention_core_backward(core_.get(), be, d_qkv, d_y, r.qkv, r.y, r.lse, B, Tn, Cl_, NHl_,
                          local_heads(probs));
  c_attn_.backward(ps, d_x, d_qkv, x, BT, GradWrite::kSet);
  set_input_gradient(be, g_, rows, C_, dx, d_x);
}

ParallelMlp::ParallelMlp(ParamLayout& layout, const std::string& prefix, int64_t C, float proj_std,
                         const Group& g)
    : g_(g),
      C_(C),
      Hl_(4 * C / g.size()),
      c_fc_(layout, prefix + ".c_fc", C, 4 * C, kInitStd, g),
      c_proj_(layout, prefix + ".c_proj", 4 * C, C, proj_std, g) {
  LOOM_CHECK_KIND(kConfig, (4 * C) % g.size() == 0,
                  "4 x model.n_embd ({}) is not divisible by parallel.tensor {}", 4 * C, g.size());
}

int64_t ParallelMlp::record_elems(const Rows& rows, bool selective) const {
  return rows.all() * Hl_ * (selective ? 1 : 2);
}

int64_t ParallelMlp::recompute_elems(const Rows& rows, bool selective) const {
  return selective ? rows.all() * Hl_ : 0;
}

int64_t ParallelMlp::scratch_elems(const Rows& rows) const {
  const int64_t BT = rows.all();
  return BT * (2 * Hl_ + C_) + (rows.split() ? 2 * BT * C_ : 0);
}

void ParallelMlp::forward(const ParamStore<float>& ps, float* record, bool selective, float* out,
                          const float* x, const Rows& rows, float* recompute) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.all();
  float* fch = record;
  float* fch_gelu = selective ? recompute : record + BT * Hl_;
  Buffer all;  // sequence parallelism: the gathered input, then the partial output
  if (rows.split()) {
    all = be.alloc(static_cast<size_t>(BT * C_) * sizeof(float), MemCategory::kWorkspace);
    g_.gather(x, all.as<float>(), rows.count * C_);
    x = all.as<float>();
  }
  c_fc_.forward(ps, fch, x, BT);
  be.gelu_forward(fch_gelu, fch, BT * Hl_);
  if (out == nullptr) return;  // a recomputation for backward
  if (rows.split())
    c_proj_.forward_rows(ps, out, fch_gelu, BT, all.as<float>());
  else
    c_proj_.forward(ps, out, fch_gelu, BT);
}

void ParallelMlp::backward(const ParamStore<float>& ps, float* record, bool selective, float* dx,
                           const float* dout, const float* x, const Rows& rows, float* scratch,
                           float* recompute) const {
  const auto& be = ps.backend();
  const int64_t BT = rows.all();
  const float* fch = record;
  float* fch_gelu = selective ? recompute : record + BT * Hl_;
  if (selective) be.gelu_forward(fch_gelu, fch, BT * Hl_);
  Arena<float> a(scratch);
  float* d_fch = a.take(BT * Hl_);
  float* d_fch_gelu = a.take(BT * Hl_);
  float* d_x = a.take(BT * C_);
  gather_for_backward(g_, rows, C_, dout, x, a);
  // The scratch gradients written over, never zero-filled first.
  c_proj_.backward(ps, d_fch_gelu, dout, fch_gelu, BT, GradWrite::kSet);
  be.gelu_backward(d_fch, fch, d_fch_gelu, BT * Hl_);  // written over
  c_fc_.backward(ps, d_x, d_fch, x, BT, GradWrite::kSet);
  set_input_gradient(be, g_, rows, C_, dx, d_x);
}

}  // namespace loom::tp
