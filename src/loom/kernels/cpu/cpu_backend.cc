#include "loom/kernels/cpu/cpu_backend.h"

#include <type_traits>

#include "loom/core/error.h"
#include "loom/kernels/cpu/adamw.h"
#include "loom/kernels/cpu/attention.h"
#include "loom/kernels/cpu/cross_entropy.h"
#include "loom/kernels/cpu/elementwise.h"
#include "loom/kernels/cpu/encoder.h"
#include "loom/kernels/cpu/layernorm.h"
#include "loom/kernels/cpu/matmul.h"
#include "loom/kernels/cpu/precision.h"

namespace loom {

template <typename T>
CpuBackend<T>::CpuBackend(cpu::GemmConfig g) : g_(g) {
  cpu::check_gemm_backend(g.backend);
  LOOM_CHECK(g.inputs == DType::kF32 || g.inputs == DType::kBF16 || g.inputs == DType::kF16,
             "GEMM inputs {}", dtype_name(g.inputs));
}

template <typename T>
std::string CpuBackend<T>::name() const {
  std::string s = format("cpu ({}", cpu::gemm_backend_name(g_.backend));
  if (g_.inputs != DType::kF32) s += format(", {} GEMM inputs", dtype_name(g_.inputs));
  return s + ")";
}

template <typename T>
Buffer CpuBackend<T>::alloc(size_t bytes, MemCategory category, bool zeroed) const {
  return Buffer(bytes, category, zeroed);
}

template <typename T>
std::unique_ptr<WeightPacks> CpuBackend<T>::make_weight_packs() const {
  if constexpr (std::is_same_v<T, float>) return cpu::make_weight_packs();
  return nullptr;
}

template <typename T>
void CpuBackend<T>::gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                         int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) const {
  cpu::gemm<T>(g_, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
template <typename T>
void CpuBackend<T>::matmul_forward(T* out, InputArg<T> inp, WeightArg<T> weight, const T* bias,
                                   int64_t N, int64_t C, int64_t OC) const {
  cpu::matmul_forward<T>(g_, out, inp, weight, bias, N, C, OC);
}
template <typename T>
void CpuBackend<T>::matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, InputArg<T> inp,
                                    WeightArg<T> weight, int64_t N, int64_t C, int64_t OC,
                                    GradWrite dinp_write) const {
  cpu::matmul_backward<T>(g_, dinp, dweight, dbias, dout, inp, weight, N, C, OC, dinp_write);
}
template <typename T>
bool CpuBackend<T>::reads_inputs16() const {
  return std::is_same_v<T, float> && g_.inputs == DType::kBF16 &&
         cpu::gemm_16_uses_bf16_matmul(DType::kBF16);
}
template <typename T>
void CpuBackend<T>::matmul_nt_forward(T* out, const T* inp, WeightArg<T> weight, int64_t N,
                                      int64_t C, int64_t V) const {
  cpu::matmul_nt_forward<T>(g_, out, inp, weight, N, C, V);
}
template <typename T>
void CpuBackend<T>::matmul_nt_backward(T* dinp, T* dweight, InputArg<T> dout, const T* inp,
                                       WeightArg<T> weight, int64_t N, int64_t C, int64_t V) const {
  cpu::matmul_nt_backward<T>(g_, dinp, dweight, dout, inp, weight, N, C, V);
}
template <typename T>
void CpuBackend<T>::layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight,
                                      const T* bias, int64_t N, int64_t C) const {
  cpu::layernorm_forward<T>(out, mean, rstd, inp, weight, bias, N, C);
}
template <typename T>
void CpuBackend<T>::layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                                       const T* weight, const T* mean, const T* rstd, int64_t N,
                                       int64_t C) const {
  cpu::layernorm_backward<T>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}
template <typename T>
void CpuBackend<T>::gelu_forward(T* out, const T* inp, int64_t n) const {
  cpu::gelu_forward<T>(out, inp, n);
}
template <typename T>
void CpuBackend<T>::gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const {
  cpu::gelu_backward<T>(dinp, inp, dout, n);
}
template <typename T>
void CpuBackend<T>::residual_forward(T* out, const T* a, const T* b, int64_t n) const {
  cpu::residual_forward<T>(out, a, b, n);
}
template <typename T>
void CpuBackend<T>::add(T* dst, const T* src, int64_t n) const {
  cpu::add_inplace<T>(dst, src, n);
}
template <typename T>
void CpuBackend<T>::bias_add(T* y, const T* bias, int64_t N, int64_t C) const {
  cpu::bias_add<T>(y, bias, N, C);
}
template <typename T>
void CpuBackend<T>::dropout(T* x, const DropoutSpec& spec, int64_t Tn, int64_t C, int64_t row0,
                            int64_t n) const {
  cpu::dropout_rows<T>(x, spec, Tn, C, row0, n);
}
template <typename T>
void CpuBackend<T>::dropout_residual(T* out, const T* x, const T* residual, const DropoutSpec& spec,
                                     int64_t Tn, int64_t C, int64_t row0, int64_t n) const {
  cpu::dropout_residual_rows<T>(out, x, residual, spec, Tn, C, row0, n);
}
template <typename T>
void CpuBackend<T>::attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn,
                                      int64_t C, int64_t NH, const DropoutSpec& dropout) const {
  cpu::attention_forward<T>(g_, out, lse, qkv, B, Tn, C, NH, dropout);
}
// The core writes q|k|v's bf16 rows itself (from the tiles it rounds for
// its bf16 products), and backward reads them as its tiles.
template <typename T>
void CpuBackend<T>::attention_forward_16(float* out, float* lse, const float* qkv, uint16_t* qkv16,
                                         int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                         const DropoutSpec& dropout) const {
  if constexpr (!std::is_same_v<T, float>)
    this->unsupported(Op::kAttentionForward16);
  else
    cpu::attention_forward<float>(g_, out, lse, qkv, B, Tn, C, NH, dropout, qkv16);
}
template <typename T>
void CpuBackend<T>::attention_backward_16(float* dqkv, const float* dout, const uint16_t* qkv16,
                                          const float* out, const float* lse, int64_t B, int64_t Tn,
                                          int64_t C, int64_t NH, const DropoutSpec& dropout) const {
  if constexpr (!std::is_same_v<T, float>)
    this->unsupported(Op::kAttentionBackward16);
  else
    cpu::attention_backward<float>(g_, dqkv, dout, nullptr, out, lse, B, Tn, C, NH, dropout, qkv16);
}
template <typename T>
void CpuBackend<T>::attention_chunk_forward(T* out, T* lse, const T* q, const T* kv,
                                            const AttentionChunk& a,
                                            const DropoutSpec& dropout) const {
  cpu::attention_chunk_forward<T>(g_, out, lse, q, kv, a, dropout);
}

template <typename T>
void CpuBackend<T>::attention_chunk_backward(T* dq, T* dkv, const T* dout, const T* q, const T* kv,
                                             const T* out, const T* lse, const AttentionChunk& a,
                                             const DropoutSpec& dropout) const {
  cpu::attention_chunk_backward<T>(g_, dq, dkv, dout, q, kv, out, lse, a, dropout);
}

template <typename T>
void CpuBackend<T>::attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out,
                                       const T* lse, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                       const DropoutSpec& dropout) const {
  cpu::attention_backward<T>(g_, dqkv, dout, qkv, out, lse, B, Tn, C, NH, dropout);
}
template <typename T>
void CpuBackend<T>::cross_entropy_forward(T* losses, T* lse, const T* logits,
                                          const int32_t* targets, int64_t N, int64_t V,
                                          int64_t Vp) const {
  cpu::cross_entropy_forward<T>(losses, lse, logits, targets, N, V, Vp);
}
template <typename T>
void CpuBackend<T>::cross_entropy_backward(T* logits, const T* lse, const int32_t* targets,
                                           const T* dloss, int64_t N, int64_t V, int64_t Vp,
                                           int64_t v0) const {
  cpu::cross_entropy_backward<T>(logits, lse, targets, dloss, N, V, Vp, v0);
}
template <typename T>
void CpuBackend<T>::cross_entropy_backward_16(uint16_t* dlogits16, const float* logits,
                                              const float* lse, const int32_t* targets,
                                              const float* dloss, int64_t N, int64_t V, int64_t Vp,
                                              int64_t v0, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kCrossEntropyBackward16);
  cpu::cross_entropy_backward_16(dlogits16, logits, lse, targets, dloss, N, V, Vp, v0, t);
}
template <typename T>
void CpuBackend<T>::vocab_logit_stats(T* mx, T* target, const T* logits, const int32_t* targets,
                                      int64_t N, int64_t V, int64_t Vp, int64_t v0) const {
  cpu::vocab_logit_stats<T>(mx, target, logits, targets, N, V, Vp, v0);
}
template <typename T>
void CpuBackend<T>::vocab_sum_exp(T* sum, const T* logits, const T* mx, int64_t N, int64_t V,
                                  int64_t Vp) const {
  cpu::vocab_sum_exp<T>(sum, logits, mx, N, V, Vp);
}
template <typename T>
void CpuBackend<T>::encoder_forward(T* out, const int32_t* tokens, WeightArg<T> wte,
                                    WeightArg<T> wpe, int64_t B, int64_t Tn, int64_t C,
                                    const int32_t* pos) const {
  cpu::encoder_forward<T>(out, tokens, wte, wpe, B, Tn, C, pos);
}
template <typename T>
void CpuBackend<T>::encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens,
                                     int64_t B, int64_t Tn, int64_t C, int64_t v0, int64_t v1,
                                     const int32_t* pos) const {
  cpu::encoder_backward<T>(dwte, dwpe, dout, tokens, B, Tn, C, v0, v1, pos);
}
template <typename T>
void CpuBackend<T>::embedding_lookup(T* out, const int32_t* tokens, WeightArg<T> wte, int64_t N,
                                     int64_t C, int64_t v0, int64_t v1) const {
  cpu::embedding_lookup<T>(out, tokens, wte, N, C, v0, v1);
}
template <typename T>
void CpuBackend<T>::add_positions(T* out, WeightArg<T> wpe, int64_t Tn, int64_t C, int64_t row0,
                                  int64_t n, const int32_t* pos) const {
  cpu::add_positions<T>(out, wpe, Tn, C, row0, n, pos);
}
template <typename T>
void CpuBackend<T>::adamw(T* params, const T* grads, T* m, T* v, int64_t n,
                          const AdamWParams& hp) const {
  cpu::adamw_update<T>(params, grads, m, v, n, hp);
}
template <typename T>
double CpuBackend<T>::sum_squares(const T* x, int64_t n) const {
  return cpu::sum_squares<T>(x, n);
}
template <typename T>
void CpuBackend<T>::scale(T* x, int64_t n, T s) const {
  cpu::scale_inplace<T>(x, n, s);
}
template <typename T>
void CpuBackend<T>::copy(T* dst, const T* src, int64_t n) const {
  cpu::copy<T>(dst, src, n);
}
template <typename T>
void CpuBackend<T>::fill(T* x, int64_t n, T value) const {
  cpu::fill<T>(x, n, value);
}
template <typename T>
void CpuBackend<T>::axpy(T* y, T a, const T* x, int64_t n) const {
  cpu::axpy<T>(y, a, x, n);
}

// The 16-bit operations run for f32 only.
template <typename T>
void CpuBackend<T>::adamw_16(float* master, const uint16_t* grads, float grad_scale, float* m,
                             float* v, uint16_t* params, int64_t n, DType t,
                             const AdamWParams& hp) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kAdamW16);
  cpu::adamw_update_16(master, grads, grad_scale, m, v, params, n, t, hp);
}
template <typename T>
double CpuBackend<T>::sum_squares_16(const uint16_t* x, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kSumSquares16);
  return cpu::sum_squares_16(x, n, t);
}
template <typename T>
void CpuBackend<T>::scale_16(uint16_t* x, int64_t n, float s, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kScale16);
  cpu::scale_16(x, n, s, t);
}
template <typename T>
void CpuBackend<T>::layernorm_forward_16(uint16_t* out16, float* mean, float* rstd,
                                         const float* inp, const float* weight, const float* bias,
                                         int64_t N, int64_t C, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kLayerNormForward16);
  cpu::layernorm_forward_16(out16, mean, rstd, inp, weight, bias, N, C, t);
}

template <typename T>
void CpuBackend<T>::gelu_forward_16(uint16_t* out16, const float* inp, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kGeluForward16);
  cpu::gelu_forward_16(out16, inp, n, t);
}
template <typename T>
void CpuBackend<T>::gelu_forward_record_16(float* out, uint16_t* out16, const float* inp,
                                           uint16_t* inp16, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kGeluForwardRecord16);
  cpu::gelu_forward_record_16(out, out16, inp, inp16, n, t);
}
template <typename T>
void CpuBackend<T>::gelu_backward_16(float* dinp, const uint16_t* inp16, const float* dout,
                                     int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kGeluBackward16);
  cpu::gelu_backward_16(dinp, inp16, dout, n, t);
}
template <typename T>
void CpuBackend<T>::round_16(const float* x, uint16_t* out, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kRound16);
  cpu::round_to_16(x, out, n, t);
}
template <typename T>
void CpuBackend<T>::widen_16(const uint16_t* x, float* out, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kWiden16);
  cpu::widen_16(x, out, n, t);
}
template <typename T>
void CpuBackend<T>::accumulate_16(const float* x, const uint16_t* x16, float scale, uint16_t* acc,
                                  int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kAccumulate16);
  if (x16 != nullptr)
    cpu::accumulate_16(x16, scale, acc, n, t);
  else
    cpu::accumulate_16(x, scale, acc, n, t);
}
template <typename T>
bool CpuBackend<T>::nonfinite_16(const uint16_t* x, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kNonfinite16);
  return cpu::any_nonfinite_16(x, n, t);
}

template class CpuBackend<float>;
template class CpuBackend<double>;

template <typename T>
const Backend<T>& default_backend() {
  static const CpuBackend<T> backend;
  return backend;
}
template const Backend<float>& default_backend<float>();
template const Backend<double>& default_backend<double>();

}  // namespace loom
