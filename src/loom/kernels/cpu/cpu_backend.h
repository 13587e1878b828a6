// The CPU backend: the backend table over the kernels in kernels/cpu, with
// its own GEMM configuration (OpenBLAS or oneDNN, inputs as they are or
// rounded to 16 bits), fixed when it is made. Two backends with different
// configurations work side by side in one process.
#pragma once

#include "loom/kernels/backend.h"
#include "loom/kernels/cpu/gemm_backend.h"

namespace loom {

template <typename T>
class CpuBackend final : public Backend<T> {
 public:
  // Throws Error(kUnsupported) when g.backend is not in this build.
  explicit CpuBackend(cpu::GemmConfig g = {});
  const cpu::GemmConfig& gemm_config() const { return g_; }

  std::string name() const override;
  Device device() const override { return Device::kCpu; }
  Buffer alloc(size_t bytes, MemCategory category, bool zeroed) const override;
  std::unique_ptr<WeightPacks> make_weight_packs() const override;

  void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
            const T* B, int64_t ldb, T beta, T* C, int64_t ldc) const override;
  void matmul_forward(T* out, InputArg<T> inp, WeightArg<T> weight, const T* bias, int64_t N,
                      int64_t C, int64_t OC) const override;
  void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, InputArg<T> inp,
                       WeightArg<T> weight, int64_t N, int64_t C, int64_t OC,
                       GradWrite dinp_write) const override;
  bool reads_inputs16() const override;
  bool fuses_record16() const override { return std::is_same_v<T, float>; }
  void matmul_nt_forward(T* out, const T* inp, WeightArg<T> weight, int64_t N, int64_t C,
                         int64_t V) const override;
  void matmul_nt_backward(T* dinp, T* dweight, InputArg<T> dout, const T* inp, WeightArg<T> weight,
                          int64_t N, int64_t C, int64_t V) const override;
  void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias,
                         int64_t N, int64_t C) const override;
  void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                          const T* weight, const T* mean, const T* rstd, int64_t N,
                          int64_t C) const override;
  void gelu_forward(T* out, const T* inp, int64_t n) const override;
  void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const override;
  void layernorm_forward_16(uint16_t* out16, float* mean, float* rstd, const float* inp,
                            const float* weight, const float* bias, int64_t N, int64_t C,
                            DType t) const override;
  void gelu_forward_16(uint16_t* out16, const float* inp, int64_t n, DType t) const override;
  void gelu_forward_record_16(float* out, uint16_t* out16, const float* inp, uint16_t* inp16,
                              int64_t n, DType t) const override;
  void gelu_backward_16(float* dinp, const uint16_t* inp16, const float* dout, int64_t n,
                        DType t) const override;
  void residual_forward(T* out, const T* a, const T* b, int64_t n) const override;
  void add(T* dst, const T* src, int64_t n) const override;
  void bias_add(T* y, const T* bias, int64_t N, int64_t C) const override;
  void dropout_residual(T* out, const T* x, const T* residual, const DropoutSpec& spec, int64_t Tn,
                        int64_t C, int64_t row0, int64_t n) const override;
  void dropout(T* x, const DropoutSpec& spec, int64_t Tn, int64_t C, int64_t row0,
               int64_t n) const override;
  void attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                         const DropoutSpec& dropout) const override;
  void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse,
                          int64_t B, int64_t Tn, int64_t C, int64_t NH,
                          const DropoutSpec& dropout) const override;
  void attention_forward_16(float* out, float* lse, const float* qkv, uint16_t* qkv16, int64_t B,
                            int64_t Tn, int64_t C, int64_t NH,
                            const DropoutSpec& dropout) const override;
  void attention_backward_16(float* dqkv, const float* dout, const uint16_t* qkv16,
                             const float* out, const float* lse, int64_t B, int64_t Tn, int64_t C,
                             int64_t NH, const DropoutSpec& dropout) const override;
  void attention_chunk_forward(T* out, T* lse, const T* q, const T* kv, const AttentionChunk& a,
                               const DropoutSpec& dropout) const override;
  void attention_chunk_backward(T* dq, T* dkv, const T* dout, const T* q, const T* kv, const T* out,
                                const T* lse, const AttentionChunk& a,
                                const DropoutSpec& dropout) const override;
  void cross_entropy_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int64_t N,
                             int64_t V, int64_t Vp) const override;
  void cross_entropy_backward(T* logits, const T* lse, const int32_t* targets, const T* dloss,
                              int64_t N, int64_t V, int64_t Vp, int64_t v0) const override;
  void cross_entropy_backward_16(uint16_t* dlogits16, const float* logits, const float* lse,
                                 const int32_t* targets, const float* dloss, int64_t N, int64_t V,
                                 int64_t Vp, int64_t v0, DType t) const override;
  void vocab_logit_stats(T* mx, T* target, const T* logits, const int32_t* targets, int64_t N,
                         int64_t V, int64_t Vp, int64_t v0) const override;
  void vocab_sum_exp(T* sum, const T* logits, const T* mx, int64_t N, int64_t V,
                     int64_t Vp) const override;
  void encoder_forward(T* out, const int32_t* tokens, WeightArg<T> wte, WeightArg<T> wpe, int64_t B,
                       int64_t Tn, int64_t C, const int32_t* pos) const override;
  void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int64_t B,
                        int64_t Tn, int64_t C, int64_t v0, int64_t v1,
                        const int32_t* pos) const override;
  void embedding_lookup(T* out, const int32_t* tokens, WeightArg<T> wte, int64_t N, int64_t C,
                        int64_t v0, int64_t v1) const override;
  void add_positions(T* out, WeightArg<T> wpe, int64_t Tn, int64_t C, int64_t row0, int64_t n,
                     const int32_t* pos) const override;
  void adamw(T* params, const T* grads, T* m, T* v, int64_t n,
             const AdamWParams& hp) const override;
  void adamw_16(float* master, const uint16_t* grads, float grad_scale, float* m, float* v,
                uint16_t* params, int64_t n, DType t, const AdamWParams& hp) const override;
  double sum_squares(const T* x, int64_t n) const override;
  double sum_squares_16(const uint16_t* x, int64_t n, DType t) const override;
  void scale(T* x, int64_t n, T s) const override;
  void scale_16(uint16_t* x, int64_t n, float s, DType t) const override;
  void round_16(const float* x, uint16_t* out, int64_t n, DType t) const override;
  void widen_16(const uint16_t* x, float* out, int64_t n, DType t) const override;
  void accumulate_16(const float* x, const uint16_t* x16, float scale, uint16_t* acc, int64_t n,
                     DType t) const override;
  bool nonfinite_16(const uint16_t* x, int64_t n, DType t) const override;
  void copy(T* dst, const T* src, int64_t n) const override;
  void fill(T* x, int64_t n, T value) const override;
  void axpy(T* y, T a, const T* x, int64_t n) const override;

 private:
  cpu::GemmConfig g_;
};

extern template class CpuBackend<float>;
extern template class CpuBackend<double>;

}  // namespace loom
