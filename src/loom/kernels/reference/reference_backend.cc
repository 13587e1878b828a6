#include "loom/kernels/reference/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <vector>

#include "loom/core/error.h"

namespace loom {

namespace {

double widen(uint16_t x, DType t) {
  return t == DType::kBF16 ? bf16_to_f32(x) : f16_to_f32(x);
}
uint16_t narrow(float x, DType t) {
  return t == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
}
void check_16(DType t) {
  LOOM_CHECK(t == DType::kBF16 || t == DType::kF16, "a 16-bit operation asked for {}",
             dtype_name(t));
}

// Element (i, j) of op(X), X row-major with leading dimension ld.
template <typename T>
double at(const T* X, int64_t ld, bool trans, int64_t i, int64_t j) {
  return double(trans ? X[j * ld + i] : X[i * ld + j]);
}

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)

// GELU (tanh form) in double, for both forward operations.
double gelu_of(double x) {
  return 0.5 * x * (1 + std::tanh(kGeluScale * (x + 0.044715 * x * x * x)));
}

}  // namespace

template <typename T>
std::string ReferenceBackend<T>::name() const {
  return "reference";
}

template <typename T>
Buffer ReferenceBackend<T>::alloc(size_t bytes, MemCategory category, bool zeroed) const {
  return Buffer(bytes, category, zeroed);
}

template <typename T>
void ReferenceBackend<T>::gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha,
                               const T* A, int64_t lda, const T* B, int64_t ldb, T beta, T* C,
                               int64_t ldc) const {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += at(A, lda, ta, i, k) * at(B, ldb, tb, k, j);
      T& c = C[i * ldc + j];
      c = T(double(alpha) * acc + (beta == T(0) ? 0.0 : double(beta) * double(c)));
    }
}

template <typename T>
void ReferenceBackend<T>::matmul_forward(T* out, InputArg<T> input, WeightArg<T> weight,
                                         const T* bias, int64_t N, int64_t C, int64_t OC) const {
  LOOM_CHECK(input.r16 == nullptr, "backend {} takes no bf16 input twins", name());
  const T* inp = input.data;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = bias ? double(bias[o]) : 0.0;
      for (int64_t c = 0; c < C; ++c) acc += double(inp[n * C + c]) * double(weight[c * OC + o]);
      out[n * OC + o] = T(acc);
    }
}

template <typename T>
void ReferenceBackend<T>::matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout,
                                          InputArg<T> input, WeightArg<T> weight, int64_t N,
                                          int64_t C, int64_t OC, GradWrite dinp_write) const {
  LOOM_CHECK(input.r16 == nullptr, "backend {} takes no bf16 input twins", name());
  const T* inp = input.data;
  if (dinp != nullptr)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t o = 0; o < OC; ++o)
          acc += double(dout[n * OC + o]) * double(weight[c * OC + o]);
        dinp[n * C + c] = T((dinp_write == GradWrite::kSet ? 0.0 : double(dinp[n * C + c])) + acc);
      }
  if (dweight != nullptr)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t o = 0; o < OC; ++o) {
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) acc += double(inp[n * C + c]) * double(dout[n * OC + o]);
        dweight[c * OC + o] = T(double(dweight[c * OC + o]) + acc);
      }
  if (dbias != nullptr)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = 0;
      for (int64_t n = 0; n < N; ++n) acc += double(dout[n * OC + o]);
      dbias[o] = T(double(dbias[o]) + acc);
    }
}

template <typename T>
void ReferenceBackend<T>::matmul_nt_forward(T* out, const T* inp, WeightArg<T> weight, int64_t N,
                                            int64_t C, int64_t V) const {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0;
      for (int64_t c = 0; c < C; ++c) acc += double(inp[n * C + c]) * double(weight[v * C + c]);
      out[n * V + v] = T(acc);
    }
}

template <typename T>
void ReferenceBackend<T>::matmul_nt_backward(T* dinp, T* dweight, InputArg<T> dout_arg,
                                             const T* inp, WeightArg<T> weight, int64_t N,
                                             int64_t C, int64_t V) const {
  LOOM_CHECK(dout_arg.r16 == nullptr, "backend {} takes no bf16 input twins", name());
  const T* dout = dout_arg.data;
  if (dinp != nullptr)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t v = 0; v < V; ++v) acc += double(dout[n * V + v]) * double(weight[v * C + c]);
        dinp[n * C + c] = T(double(dinp[n * C + c]) + acc);
      }
  if (dweight != nullptr)
    for (int64_t v = 0; v < V; ++v)
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) acc += double(dout[n * V + v]) * double(inp[n * C + c]);
        dweight[v * C + c] = T(double(dweight[v * C + c]) + acc);
      }
}

namespace {

// One row of a LayerNorm in f64: out (C) as U, its mean and rstd as T.
template <typename T, typename U>
void layernorm_row(U* out, T* mean, T* rstd, const T* x, const T* weight, const T* bias,
                   int64_t C) {
  double m = 0, var = 0;
  for (int64_t c = 0; c < C; ++c) m += double(x[c]);
  m /= double(C);
  for (int64_t c = 0; c < C; ++c) var += (double(x[c]) - m) * (double(x[c]) - m);
  const double s = 1.0 / std::sqrt(var / double(C) + kLayerNormEps);
  for (int64_t c = 0; c < C; ++c)
    out[c] = U((double(x[c]) - m) * s * double(weight[c]) + double(bias[c]));
  *mean = T(m);
  *rstd = T(s);
}

}  // namespace

template <typename T>
void ReferenceBackend<T>::layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight,
                                            const T* bias, int64_t N, int64_t C) const {
  for (int64_t n = 0; n < N; ++n)
    layernorm_row(out + n * C, mean + n, rstd + n, inp + n * C, weight, bias, C);
}

template <typename T>
void ReferenceBackend<T>::layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout,
                                             const T* inp, const T* weight, const T* mean,
                                             const T* rstd, int64_t N, int64_t C) const {
  for (int64_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    const T* dy = dout + n * C;
    const double m = double(mean[n]), s = double(rstd[n]);
    if (dweight != nullptr)
      for (int64_t c = 0; c < C; ++c) {
        const double xhat = (double(x[c]) - m) * s;
        dweight[c] = T(double(dweight[c]) + double(dy[c]) * xhat);
        dbias[c] = T(double(dbias[c]) + double(dy[c]));
      }
    if (dinp == nullptr) continue;
    // dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy * weight.
    double g_mean = 0, gx_mean = 0;
    for (int64_t c = 0; c < C; ++c) {
      const double g = double(dy[c]) * double(weight[c]);
      g_mean += g;
      gx_mean += g * (double(x[c]) - m) * s;
    }
    g_mean /= double(C);
    gx_mean /= double(C);
    for (int64_t c = 0; c < C; ++c) {
      const double xhat = (double(x[c]) - m) * s;
      const double g = double(dy[c]) * double(weight[c]);
      dinp[n * C + c] = T(double(dinp[n * C + c]) + s * (g - g_mean - xhat * gx_mean));
    }
  }
}

template <typename T>
void ReferenceBackend<T>::gelu_forward(T* out, const T* inp, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) out[i] = T(gelu_of(double(inp[i])));
}

template <typename T>
void ReferenceBackend<T>::gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) {
    const double x = double(inp[i]);
    const double th = std::tanh(kGeluScale * (x + 0.044715 * x * x * x));
    const double d =
        0.5 * (1 + th) + 0.5 * x * (1 - th * th) * kGeluScale * (1 + 3 * 0.044715 * x * x);
    dinp[i] = T(d * double(dout[i]));
  }
}

template <typename T>
void ReferenceBackend<T>::residual_forward(T* out, const T* a, const T* b, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}
template <typename T>
void ReferenceBackend<T>::add(T* dst, const T* src, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}
template <typename T>
void ReferenceBackend<T>::bias_add(T* y, const T* bias, int64_t N, int64_t C) const {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) y[n * C + c] += bias[c];
}

template <typename T>
void ReferenceBackend<T>::dropout(T* x, const DropoutSpec& spec, int64_t Tn, int64_t C,
                                  int64_t row0, int64_t n) const {
  if (!spec.active()) return;
  std::vector<T> keep(static_cast<size_t>(C));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = (row0 + i) / Tn, t = (row0 + i) % Tn;
    spec.stream->row(spec.sample0 + static_cast<uint64_t>(b), spec.site, spec.position(t), 0, C,
                     keep.data());
    for (int64_t c = 0; c < C; ++c) x[i * C + c] *= keep[static_cast<size_t>(c)];
  }
}

template <typename T>
void ReferenceBackend<T>::dropout_residual(T* out, const T* x, const T* residual,
                                           const DropoutSpec& spec, int64_t Tn, int64_t C,
                                           int64_t row0, int64_t n) const {
  std::vector<T> keep(static_cast<size_t>(C), T(1));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = (row0 + i) / Tn, t = (row0 + i) % Tn;
    if (spec.active())
      spec.stream->row(spec.sample0 + static_cast<uint64_t>(b), spec.site, spec.position(t), 0, C,
                       keep.data());
    for (int64_t c = 0; c < C; ++c) {
      const double r = residual != nullptr ? double(residual[i * C + c]) : 0.0;
      out[i * C + c] = T(double(x[i * C + c]) * double(keep[static_cast<size_t>(c)]) + r);
    }
  }
}

namespace {

// The keep mask of query i of (b, h) over keys [0, Tn): all ones without dropout.
template <typename T>
void attention_keep(std::vector<T>& keep, const DropoutSpec& d, int64_t b, int64_t h, int64_t i,
                    int64_t Tn) {
  keep.assign(static_cast<size_t>(Tn), T(1));
  if (d.active())
    d.stream->row(d.sample0 + static_cast<uint64_t>(b), d.site + static_cast<uint32_t>(h),
                  static_cast<uint32_t>(i), 0, Tn, keep.data());
}

}  // namespace

template <typename T>
void ReferenceBackend<T>::attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn,
                                            int64_t C, int64_t NH,
                                            const DropoutSpec& dropout) const {
  const int64_t hs = C / NH;
  const double scale = 1.0 / std::sqrt(double(hs));
  std::vector<double> s(static_cast<size_t>(Tn));
  std::vector<T> keep;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t i = 0; i < Tn; ++i) {
        const T* q = qkv + (b * Tn + i) * 3 * C + h * hs;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          const T* k = qkv + (b * Tn + j) * 3 * C + C + h * hs;
          double dot = 0;
          for (int64_t d = 0; d < hs; ++d) dot += double(q[d]) * double(k[d]);
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - mx);
        lse[(b * NH + h) * Tn + i] = T(mx + std::log(sum));
        attention_keep(keep, dropout, b, h, i, Tn);
        for (int64_t d = 0; d < hs; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j)
            acc += std::exp(s[j] - mx) / sum * double(keep[j]) *
                   double(qkv[(b * Tn + j) * 3 * C + 2 * C + h * hs + d]);
          out[(b * Tn + i) * C + h * hs + d] = T(acc);
        }
      }
}

// The plain definition of a chunk pair: for each query, the scores of the
// keys it sees, their log-sum-exp lb and output ob, merged with what out
// and lse held: lse' = log(e^lse + e^lb), out' = out e^(lse - lse') + ob e^(lb - lse').
template <typename T>
void ReferenceBackend<T>::attention_chunk_forward(T* out, T* lse, const T* q, const T* kv,
                                                  const AttentionChunk& a,
                                                  const DropoutSpec& dropout) const {
  const int64_t hs = a.C / a.NH;
  const double scale = 1.0 / std::sqrt(double(hs));
  std::vector<double> s(static_cast<size_t>(a.Tk));
  std::vector<T> keep(static_cast<size_t>(a.Tk));
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.NH; ++h)
      for (int64_t i = 0; i < a.Tq; ++i) {
        const int64_t n = std::min(a.Tk, a.q_pos + i - a.k_pos + 1);  // keys seen
        if (n <= 0) continue;
        const T* qi = q + b * a.q_batch + i * a.q_row + h * hs;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          const T* k = kv + b * a.kv_batch + j * a.kv_row + h * hs;
          double dot = 0;
          for (int64_t d = 0; d < hs; ++d) dot += double(qi[d]) * double(k[d]);
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < n; ++j) sum += std::exp(s[j] - mx);
        const double lb = mx + std::log(sum);
        std::fill(keep.begin(), keep.end(), T(1));
        if (dropout.active()) {  // the row's masks from key 0, read at the global positions
          std::vector<T> row(static_cast<size_t>(a.k_pos + n));
          dropout.stream->row(dropout.sample0 + static_cast<uint64_t>(b),
                              dropout.site + static_cast<uint32_t>(h),
                              static_cast<uint32_t>(a.q_pos + i), 0, a.k_pos + n, row.data());
          for (int64_t j = 0; j < n; ++j) keep[j] = row[static_cast<size_t>(a.k_pos + j)];
        }
        T& li = lse[b * a.lse_batch + h * a.lse_head + i];
        const double lo = double(li);
        const double ln = std::isinf(lo) && lo < 0 ? lb : std::log(std::exp(lo) + std::exp(lb));
        const double wo = std::isinf(lo) && lo < 0 ? 0.0 : std::exp(lo - ln);
        T* o = out + b * a.o_batch + i * a.o_row + h * hs;
        for (int64_t d = 0; d < hs; ++d) {
          double ob = 0;
          for (int64_t j = 0; j < n; ++j)
            ob += std::exp(s[j] - lb) * double(keep[j]) *
                  double(kv[b * a.kv_batch + j * a.kv_row + a.v_col + h * hs + d]);
          o[d] = T(double(o[d]) * wo + ob * std::exp(lb - ln));
        }
        li = T(ln);
      }
}

template <typename T>
void ReferenceBackend<T>::attention_chunk_backward(T* dq, T* dkv, const T* dout, const T* q,
                                                   const T* kv, const T* out, const T* lse,
                                                   const AttentionChunk& a,
                                                   const DropoutSpec& dropout) const {
  const int64_t hs = a.C / a.NH;
  const double scale = 1.0 / std::sqrt(double(hs));
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.NH; ++h)
      for (int64_t i = 0; i < a.Tq; ++i) {
        const int64_t n = std::min(a.Tk, a.q_pos + i - a.k_pos + 1);
        if (n <= 0) continue;
        const T* qi = q + b * a.q_batch + i * a.q_row + h * hs;
        const T* g = dout + b * a.o_batch + i * a.o_row + h * hs;
        const T* oi = out + b * a.o_batch + i * a.o_row + h * hs;
        const double l = double(lse[b * a.lse_batch + h * a.lse_head + i]);
        double D = 0;  // dO_i . O_i: the row term over every key
        for (int64_t d = 0; d < hs; ++d) D += double(g[d]) * double(oi[d]);
        std::vector<T> row(static_cast<size_t>(a.k_pos + n), T(1));
        if (dropout.active())
          dropout.stream->row(dropout.sample0 + static_cast<uint64_t>(b),
                              dropout.site + static_cast<uint32_t>(h),
                              static_cast<uint32_t>(a.q_pos + i), 0, a.k_pos + n, row.data());
        for (int64_t j = 0; j < n; ++j) {
          const T* k = kv + b * a.kv_batch + j * a.kv_row + h * hs;
          const T* v = k + a.v_col;
          double dot = 0, gv = 0;
          for (int64_t d = 0; d < hs; ++d) {
            dot += double(qi[d]) * double(k[d]);
            gv += double(g[d]) * double(v[d]);
          }
          const double keep = double(row[static_cast<size_t>(a.k_pos + j)]);
          const double p = std::exp(dot * scale - l);
          const double ds = p * (keep * gv - D);
          T* gk = dkv + b * a.kv_batch + j * a.kv_row + h * hs;
          T* gq = dq + b * a.q_batch + i * a.q_row + h * hs;
          for (int64_t d = 0; d < hs; ++d) {
            gq[d] = T(double(gq[d]) + ds * double(k[d]) * scale);
            gk[d] = T(double(gk[d]) + ds * double(qi[d]) * scale);
            gk[a.v_col + d] = T(double(gk[a.v_col + d]) + p * keep * double(g[d]));
          }
        }
      }
}

template <typename T>
void ReferenceBackend<T>::attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out,
                                             const T* lse, int64_t B, int64_t Tn, int64_t C,
                                             int64_t NH, const DropoutSpec& dropout) const {
  (void)out;  // D_i is recomputed from the probabilities
  const int64_t hs = C / NH;
  const double scale = 1.0 / std::sqrt(double(hs));
  std::fill_n(dqkv, B * Tn * 3 * C, T(0));  // written, then summed over the keys below
  std::vector<double> p(static_cast<size_t>(Tn)), dp(static_cast<size_t>(Tn));
  std::vector<T> keep;
  auto q_at = [&](int64_t b, int64_t t, int64_t h) { return (b * Tn + t) * 3 * C + h * hs; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t i = 0; i < Tn; ++i) {
        const T* q = qkv + q_at(b, i, h);
        const T* g = dout + (b * Tn + i) * C + h * hs;
        const double l = double(lse[(b * NH + h) * Tn + i]);
        attention_keep(keep, dropout, b, h, i, Tn);
        // p_j = softmax; dp_j = keep_j (dout_i . v_j); D = sum_j p_j dp_j.
        double D = 0;
        for (int64_t j = 0; j <= i; ++j) {
          const T* k = qkv + q_at(b, j, h) + C;
          const T* v = qkv + q_at(b, j, h) + 2 * C;
          double dot = 0, gv = 0;
          for (int64_t d = 0; d < hs; ++d) {
            dot += double(q[d]) * double(k[d]);
            gv += double(g[d]) * double(v[d]);
          }
          p[j] = std::exp(dot * scale - l);
          dp[j] = double(keep[j]) * gv;
          D += p[j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[j] * (dp[j] - D);  // d(score_j)
          T* dq = dqkv + q_at(b, i, h);
          T* dk = dqkv + q_at(b, j, h) + C;
          T* dv = dqkv + q_at(b, j, h) + 2 * C;
          const T* k = qkv + q_at(b, j, h) + C;
          for (int64_t d = 0; d < hs; ++d) {
            dq[d] = T(double(dq[d]) + ds * scale * double(k[d]));
            dk[d] = T(double(dk[d]) + ds * scale * double(q[d]));
            dv[d] = T(double(dv[d]) + p[j] * double(keep[j]) * double(g[d]));
          }
        }
      }
}

template <typename T>
void ReferenceBackend<T>::cross_entropy_forward(T* losses, T* lse, const T* logits,
                                                const int32_t* targets, int64_t N, int64_t V,
                                                int64_t Vp) const {
  for (int64_t n = 0; n < N; ++n) {
    const T* row = logits + n * Vp;
    double mx = -std::numeric_limits<double>::infinity(), sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
    const double l = mx + std::log(sum);
    lse[n] = T(l);
    losses[n] = T(l - double(row[targets[n]]));
  }
}

template <typename T>
void ReferenceBackend<T>::cross_entropy_backward(T* logits, const T* lse, const int32_t* targets,
                                                 const T* dloss, int64_t N, int64_t V, int64_t Vp,
                                                 int64_t v0) const {
  for (int64_t n = 0; n < N; ++n) {
    T* row = logits + n * Vp;
    const double d = double(dloss[n]), l = double(lse[n]);
    for (int64_t v = 0; v < Vp; ++v) {
      if (v >= V) {
        row[v] = T(0);
        continue;
      }
      const double hit = v0 + v == targets[n] ? 1.0 : 0.0;
      row[v] = T(d * (std::exp(double(row[v]) - l) - hit));
    }
  }
}

template <typename T>
void ReferenceBackend<T>::cross_entropy_backward_16(uint16_t* dlogits16, const float* logits,
                                                    const float* lse, const int32_t* targets,
                                                    const float* dloss, int64_t N, int64_t V,
                                                    int64_t Vp, int64_t v0, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kCrossEntropyBackward16);
  check_16(t);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < Vp; ++v) {
      if (v >= V) {
        dlogits16[n * Vp + v] = 0;  // padding
        continue;
      }
      const double hit = v0 + v == targets[n] ? 1.0 : 0.0;
      const double e = std::exp(double(logits[n * Vp + v]) - double(lse[n]));
      const auto g = float(double(dloss[n]) * (e - hit));
      dlogits16[n * Vp + v] = t == DType::kBF16 ? f32_to_bf16(g) : f32_to_f16(g);
    }
}

template <typename T>
void ReferenceBackend<T>::vocab_logit_stats(T* mx, T* target, const T* logits,
                                            const int32_t* targets, int64_t N, int64_t V,
                                            int64_t Vp, int64_t v0) const {
  for (int64_t n = 0; n < N; ++n) {
    const T* row = logits + n * Vp;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t v = 0; v < V; ++v) m = std::max(m, row[v]);
    mx[n] = m;
    const int64_t t = targets[n] - v0;
    target[n] = t >= 0 && t < Vp ? row[t] : T(0);
  }
}

template <typename T>
void ReferenceBackend<T>::vocab_sum_exp(T* sum, const T* logits, const T* mx, int64_t N, int64_t V,
                                        int64_t Vp) const {
  for (int64_t n = 0; n < N; ++n) {
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(double(logits[n * Vp + v]) - double(mx[n]));
    sum[n] = T(s);
  }
}

template <typename T>
void ReferenceBackend<T>::encoder_forward(T* out, const int32_t* tokens, WeightArg<T> wte,
                                          WeightArg<T> wpe, int64_t B, int64_t Tn, int64_t C,
                                          const int32_t* pos) const {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t tok = tokens[b * Tn + t], p = pos ? pos[t] : t;
      for (int64_t c = 0; c < C; ++c)
        out[(b * Tn + t) * C + c] = T(double(wte[tok * C + c]) + double(wpe[p * C + c]));
    }
}

template <typename T>
void ReferenceBackend<T>::encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens,
                                           int64_t B, int64_t Tn, int64_t C, int64_t v0, int64_t v1,
                                           const int32_t* pos) const {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t tok = tokens[b * Tn + t], p = pos ? pos[t] : t;
      const T* d = dout + (b * Tn + t) * C;
      for (int64_t c = 0; c < C; ++c) dwpe[p * C + c] += d[c];
      if (tok < v0 || tok >= v1) continue;
      for (int64_t c = 0; c < C; ++c) dwte[(tok - v0) * C + c] += d[c];
    }
}

template <typename T>
void ReferenceBackend<T>::embedding_lookup(T* out, const int32_t* tokens, WeightArg<T> wte,
                                           int64_t N, int64_t C, int64_t v0, int64_t v1) const {
  for (int64_t n = 0; n < N; ++n) {
    const int64_t tok = tokens[n];
    for (int64_t c = 0; c < C; ++c)
      out[n * C + c] = tok >= v0 && tok < v1 ? wte[(tok - v0) * C + c] : T(0);
  }
}

template <typename T>
void ReferenceBackend<T>::add_positions(T* out, WeightArg<T> wpe, int64_t Tn, int64_t C,
                                        int64_t row0, int64_t n, const int32_t* pos) const {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t local = (row0 + i) % Tn, t = pos ? pos[local] : local;
    for (int64_t c = 0; c < C; ++c) out[i * C + c] += wpe[t * C + c];
  }
}

namespace {
// One AdamW step of one element, in double.
void adamw_element(double& p, double g, double& m, double& v, const AdamWParams& hp) {
  m = hp.beta1 * m + (1 - hp.beta1) * g;
  v = hp.beta2 * v + (1 - hp.beta2) * g * g;
  const double mhat = m / (1 - std::pow(hp.beta1, double(hp.step)));
  const double vhat = v / (1 - std::pow(hp.beta2, double(hp.step)));
  p -= hp.lr * (mhat / (std::sqrt(vhat) + hp.eps) + hp.weight_decay * p);
}
}  // namespace

template <typename T>
void ReferenceBackend<T>::adamw(T* params, const T* grads, T* m, T* v, int64_t n,
                                const AdamWParams& hp) const {
  for (int64_t i = 0; i < n; ++i) {
    double p = params[i], mi = m[i], vi = v[i];
    adamw_element(p, double(grads[i]), mi, vi, hp);
    params[i] = T(p), m[i] = T(mi), v[i] = T(vi);
  }
}

template <typename T>
void ReferenceBackend<T>::adamw_16(float* master, const uint16_t* grads, float grad_scale, float* m,
                                   float* v, uint16_t* params, int64_t n, DType t,
                                   const AdamWParams& hp) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kAdamW16);
  check_16(t);
  for (int64_t i = 0; i < n; ++i) {
    double p = master[i], mi = m[i], vi = v[i];
    adamw_element(p, widen(grads[i], t) * double(grad_scale), mi, vi, hp);
    master[i] = float(p), m[i] = float(mi), v[i] = float(vi);
    params[i] = narrow(master[i], t);
  }
}

template <typename T>
double ReferenceBackend<T>::sum_squares(const T* x, int64_t n) const {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return s;
}

template <typename T>
double ReferenceBackend<T>::sum_squares_16(const uint16_t* x, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kSumSquares16);
  check_16(t);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += widen(x[i], t) * widen(x[i], t);
  return s;
}

template <typename T>
void ReferenceBackend<T>::scale(T* x, int64_t n, T s) const {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

template <typename T>
void ReferenceBackend<T>::scale_16(uint16_t* x, int64_t n, float s, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kScale16);
  check_16(t);
  for (int64_t i = 0; i < n; ++i) x[i] = narrow(float(widen(x[i], t)) * s, t);
}

template <typename T>
void ReferenceBackend<T>::layernorm_forward_16(uint16_t* out16, float* mean, float* rstd,
                                               const float* inp, const float* weight,
                                               const float* bias, int64_t N, int64_t C,
                                               DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kLayerNormForward16);
  check_16(t);
  std::vector<float> row(static_cast<size_t>(C));
  for (int64_t n = 0; n < N; ++n) {
    layernorm_row(row.data(), mean + n, rstd + n, inp + n * C, weight, bias, C);
    for (int64_t c = 0; c < C; ++c)
      out16[n * C + c] = t == DType::kBF16 ? f32_to_bf16(row[static_cast<size_t>(c)])
                                           : f32_to_f16(row[static_cast<size_t>(c)]);
  }
}

template <typename T>
void ReferenceBackend<T>::gelu_forward_16(uint16_t* out16, const float* inp, int64_t n,
                                          DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kGeluForward16);
  check_16(t);
  for (int64_t i = 0; i < n; ++i) {
    const auto y = float(gelu_of(double(inp[i])));
    out16[i] = t == DType::kBF16 ? f32_to_bf16(y) : f32_to_f16(y);
  }
}
template <typename T>
void ReferenceBackend<T>::round_16(const float* x, uint16_t* out, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kRound16);
  check_16(t);
  for (int64_t i = 0; i < n; ++i) out[i] = narrow(x[i], t);
}

template <typename T>
void ReferenceBackend<T>::widen_16(const uint16_t* x, float* out, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kWiden16);
  check_16(t);
  for (int64_t i = 0; i < n; ++i) out[i] = float(widen(x[i], t));
}

template <typename T>
void ReferenceBackend<T>::accumulate_16(const float* x, const uint16_t* x16, float scale,
                                        uint16_t* acc, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kAccumulate16);
  check_16(t);
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x16 != nullptr ? float(widen(x16[i], t)) : x[i];
    acc[i] = narrow(float(widen(acc[i], t)) + xi * scale, t);
  }
}

template <typename T>
bool ReferenceBackend<T>::nonfinite_16(const uint16_t* x, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kNonfinite16);
  check_16(t);
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(widen(x[i], t))) return true;
  return false;
}

template <typename T>
void ReferenceBackend<T>::copy(T* dst, const T* src, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
template <typename T>
void ReferenceBackend<T>::fill(T* x, int64_t n, T value) const {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}
template <typename T>
void ReferenceBackend<T>::axpy(T* y, T a, const T* x, int64_t n) const {
  for (int64_t i = 0; i < n; ++i) y[i] = T(double(y[i]) + double(a) * double(x[i]));
}

template class ReferenceBackend<float>;
template class ReferenceBackend<double>;

}  // namespace loom
