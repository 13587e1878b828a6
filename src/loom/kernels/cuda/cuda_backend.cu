// The CUDA backend's operations but attention (cuda_attention.cu): GEMMs
// through cuBLASLt, one kernel per other operation. Reductions are
// deterministic: fixed partitions summed in a fixed order (column sums in
// row chunks, sums of squares in fixed blocks, embedding gradients grouped
// by row on the host), so a run repeats itself bit for bit.
#include <algorithm>
#include <cmath>
#include <map>
#include <type_traits>
#include <vector>

#include "loom/kernels/cuda/cuda_backend.h"
#include "loom/kernels/cuda/cuda_common.cuh"

namespace loom {

using cuda::Args;
using cuda::context;
using cuda::grid_for;
using cuda::kThreads;
using cuda::launch;
using cuda::Scratch;

namespace {

// A weight as a kernel reads it: T values or 16-bit ones.
template <typename T>
struct DevWeight {
  const T* data = nullptr;
  const uint16_t* w16 = nullptr;
  bool bf16 = true;
  __device__ T at(int64_t i) const {
    return w16 != nullptr ? T(cuda::widen16(w16[i], bf16)) : data[i];
  }
};
template <typename T>
DevWeight<T> dev_weight(const Weight<T>& w, int64_t n, Args& args) {
  DevWeight<T> d;
  if (w.w16 != nullptr) {
    d.w16 = args.in(w.w16, n);
    d.bf16 = w.t == DType::kBF16;
  } else {
    d.data = args.in(w.data, n);
  }
  return d;
}

// The elements of a row-major (rows, cols) matrix with leading dimension ld.
int64_t extent(int64_t rows, int64_t cols, int64_t ld) {
  return rows == 0 || cols == 0 ? 0 : (rows - 1) * ld + cols;
}

// A copy of n int32 values wherever they live, on the host.
std::vector<int32_t> host_ints(const int32_t* p, int64_t n) {
  std::vector<int32_t> h(static_cast<size_t>(n));
  if (n > 0)
    LOOM_CUDA_CHECK(
        cudaMemcpy(h.data(), p, sizeof(int32_t) * static_cast<size_t>(n), cudaMemcpyDefault));
  return h;
}

void check_16(DType t) {
  LOOM_CHECK(t == DType::kBF16 || t == DType::kF16, "a 16-bit operation asked for {}",
             dtype_name(t));
}

// ---- kernels ------------------------------------------------------------------------

template <typename T>
__global__ void k_rows_from(T* out, const T* row, int64_t N, int64_t C) {
  LOOM_GRID_STRIDE(i, N * C) out[i] = row[i % C];
}

// C (M, N; leading dimension ldc) *= beta: a GEMM with nothing to add.
template <typename T>
__global__ void k_scale_rows(T* c, int64_t M, int64_t N, int64_t ldc, T beta) {
  LOOM_GRID_STRIDE(i, M * N) {
    T& x = c[(i / N) * ldc + i % N];
    x = beta == T(0) ? T(0) : x * beta;
  }
}

template <typename T>
__global__ void k_to16(uint16_t* out, const T* x, int64_t n, bool bf16) {
  LOOM_GRID_STRIDE(i, n) out[i] = cuda::narrow16(float(x[i]), bf16);
}

// partial[k, c] = sum of x[n, c] over rows n of chunk k (kRowChunk rows), in order.
constexpr int64_t kRowChunk = 256;
template <typename T>
__global__ void k_colsum_partial(T* partial, const T* x, int64_t N, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const int64_t n0 = blockIdx.y * kRowChunk, n1 = min(N, n0 + kRowChunk);
  T acc = 0;
  for (int64_t n = n0; n < n1; ++n) acc += x[n * C + c];
  partial[blockIdx.y * C + c] = acc;
}
// dst[c] += sum over k of partial[k, c], in order.
template <typename T>
__global__ void k_colsum_final(T* dst, const T* partial, int64_t chunks, int64_t C) {
  LOOM_GRID_STRIDE(c, C) {
    T acc = 0;
    for (int64_t k = 0; k < chunks; ++k) acc += partial[k * C + c];
    dst[c] += acc;
  }
}
// dst (C) += column sums of x (N, C).
template <typename T>
void colsum_add(T* dst, const T* x, int64_t N, int64_t C) {
  if (N == 0 || C == 0) return;
  const int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
  Scratch partial(sizeof(T) * static_cast<size_t>(chunks * C));
  const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads),
                  static_cast<unsigned>(chunks));
  k_colsum_partial<T><<<grid, kThreads, 0, context().stream>>>(partial.as<T>(), x, N, C);
  LOOM_CUDA_LAUNCHED();
  k_colsum_final<T>
      <<<grid_for(C), kThreads, 0, context().stream>>>(dst, partial.as<T>(), chunks, C);
  LOOM_CUDA_LAUNCHED();
}

// Where a LayerNorm's output goes: T values, or (f32 alone) their 16-bit
// roundings.
template <typename T>
struct StoreAs {
  T* out;
  __device__ void operator()(int64_t i, T y) const { out[i] = y; }
};
struct StoreRounded {
  uint16_t* out;
  bool bf16;
  __device__ void operator()(int64_t i, float y) const { out[i] = cuda::narrow16(y, bf16); }
};

// One warp per row.
template <typename T, typename Store>
__global__ void k_layernorm_forward(Store out, T* mean, T* rstd, const T* inp, const T* weight,
                                    const T* bias, int64_t N, int64_t C) {
  const int64_t n = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const T* x = inp + n * C;
  T s = 0;
  for (int64_t c = lane; c < C; c += 32) s += x[c];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const T m = s / T(C);
  T v = 0;
  for (int64_t c = lane; c < C; c += 32) v += (x[c] - m) * (x[c] - m);
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const T r = T(1) / sqrt(v / T(C) + T(kLayerNormEps));
  for (int64_t c = lane; c < C; c += 32) out(n * C + c, (x[c] - m) * r * weight[c] + bias[c]);
  if (lane == 0) mean[n] = m, rstd[n] = r;
}

template <typename T>
__global__ void k_layernorm_dinp(T* dinp, const T* dout, const T* inp, const T* weight,
                                 const T* mean, const T* rstd, int64_t N, int64_t C) {
  const int64_t n = blockIdx.x * int64_t{blockDim.x / 32} + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const T* x = inp + n * C;
  const T* dy = dout + n * C;
  const T m = mean[n], r = rstd[n];
  T gs = 0, gxs = 0;
  for (int64_t c = lane; c < C; c += 32) {
    const T g = dy[c] * weight[c];
    gs += g;
    gxs += g * (x[c] - m) * r;
  }
  for (int o = 16; o > 0; o >>= 1) {
    gs += __shfl_xor_sync(0xffffffffu, gs, o);
    gxs += __shfl_xor_sync(0xffffffffu, gxs, o);
  }
  gs /= T(C);
  gxs /= T(C);
  for (int64_t c = lane; c < C; c += 32) {
    const T xhat = (x[c] - m) * r;
    dinp[n * C + c] += r * (dy[c] * weight[c] - gs - xhat * gxs);
  }
}

// partial_w[k, c], partial_b[k, c]: sums of dy * xhat and dy over chunk k's rows.
template <typename T>
__global__ void k_layernorm_dparams(T* pw, T* pb, const T* dout, const T* inp, const T* mean,
                                    const T* rstd, int64_t N, int64_t C) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= C) return;
  const int64_t n0 = blockIdx.y * kRowChunk, n1 = min(N, n0 + kRowChunk);
  T w = 0, b = 0;
  for (int64_t n = n0; n < n1; ++n) {
    const T dy = dout[n * C + c];
    w += dy * (inp[n * C + c] - mean[n]) * rstd[n];
    b += dy;
  }
  pw[blockIdx.y * C + c] = w;
  pb[blockIdx.y * C + c] = b;
}

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2 / pi)

template <typename T>
__global__ void k_gelu_forward(T* out, const T* inp, int64_t n) {
  LOOM_GRID_STRIDE(i, n) {
    const T x = inp[i];
    out[i] = T(0.5) * x * (T(1) + tanh(T(kGeluScale) * (x + T(0.044715) * x * x * x)));
  }
}
__global__ void k_gelu_forward_16(uint16_t* out16, const float* inp, int64_t n, bool bf16) {
  LOOM_GRID_STRIDE(i, n) {
    const float x = inp[i];
    out16[i] = cuda::narrow16(
        0.5f * x * (1.0f + tanhf(float(kGeluScale) * (x + 0.044715f * x * x * x))), bf16);
  }
}
template <typename T>
__global__ void k_gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
  LOOM_GRID_STRIDE(i, n) {
    const T x = inp[i];
    const T th = tanh(T(kGeluScale) * (x + T(0.044715) * x * x * x));
    const T d = T(0.5) * (T(1) + th) +
                T(0.5) * x * (T(1) - th * th) * T(kGeluScale) * (T(1) + T(3 * 0.044715) * x * x);
    dinp[i] = d * dout[i];
  }
}

template <typename T>
__global__ void k_residual(T* out, const T* a, const T* b, int64_t n) {
  LOOM_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}
template <typename T>
__global__ void k_add(T* dst, const T* src, int64_t n) {
  LOOM_GRID_STRIDE(i, n) dst[i] += src[i];
}
template <typename T>
__global__ void k_bias_add(T* y, const T* bias, int64_t N, int64_t C) {
  LOOM_GRID_STRIDE(i, N * C) y[i] += bias[i % C];
}
template <typename T>
__global__ void k_dropout(T* x, cuda::DeviceDropout d, int64_t Tn, int64_t C, int64_t row0,
                          int64_t n) {
  LOOM_GRID_STRIDE(idx, n * C) {
    const int64_t i = idx / C, c = idx % C;
    const int64_t b = (row0 + i) / Tn, t = (row0 + i) % Tn;
    const uint32_t pos = static_cast<uint32_t>(d.positions ? int64_t{d.positions[t]} : t);
    x[idx] *= cuda::keep_of<T>(d, d.sample0 + static_cast<uint64_t>(b), d.site, pos, c);
  }
}
// out = x * keep (+ residual where given), one pass; out may be x.
template <typename T>
__global__ void k_dropout_residual(T* out, const T* x, const T* residual, cuda::DeviceDropout d,
                                   int64_t Tn, int64_t C, int64_t row0, int64_t n) {
  LOOM_GRID_STRIDE(idx, n * C) {
    const int64_t i = idx / C, c = idx % C;
    const int64_t b = (row0 + i) / Tn, t = (row0 + i) % Tn;
    const uint32_t pos = static_cast<uint32_t>(d.positions ? int64_t{d.positions[t]} : t);
    const T y = x[idx] * cuda::keep_of<T>(d, d.sample0 + static_cast<uint64_t>(b), d.site, pos, c);
    out[idx] = residual != nullptr ? y + residual[idx] : y;
  }
}

// One block per row: the row maximum of the first V columns and the sum of
// exp(x - max) in double.
template <typename T>
__device__ void row_max_sumexp(const T* row, int64_t V, T& mx, double& sum) {
  __shared__ T sh_t[32];
  __shared__ double sh_d[32];
  T m = T(-INFINITY);
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = max(m, row[v]);
  mx = cuda::block_max(m, sh_t);
  double s = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += exp(double(row[v]) - double(mx));
  sum = cuda::block_sum(s, sh_d);
}

template <typename T>
__global__ void k_ce_forward(T* losses, T* lse, const T* logits, const int32_t* targets, int64_t V,
                             int64_t Vp) {
  const int64_t n = blockIdx.x;
  const T* row = logits + n * Vp;
  T mx;
  double sum;
  row_max_sumexp(row, V, mx, sum);
  if (threadIdx.x == 0) {
    const double l = double(mx) + log(sum);
    lse[n] = T(l);
    losses[n] = T(l - double(row[targets[n]]));
  }
}

template <typename T>
__global__ void k_ce_backward(T* logits, const T* lse, const int32_t* targets, const T* dloss,
                              int64_t N, int64_t V, int64_t Vp, int64_t v0) {
  LOOM_GRID_STRIDE(i, N * Vp) {
    const int64_t n = i / Vp, v = i % Vp;
    if (v >= V) {
      logits[i] = T(0);
      continue;
    }
    const T hit = v0 + v == targets[n] ? T(1) : T(0);
    logits[i] = dloss[n] * (exp(logits[i] - lse[n]) - hit);
  }
}

// cross_entropy_backward's value in f32, rounded to 16 bits, logits only read.
__global__ void k_ce_backward_16(uint16_t* dlogits16, const float* logits, const float* lse,
                                 const int32_t* targets, const float* dloss, int64_t N, int64_t V,
                                 int64_t Vp, int64_t v0, bool bf16) {
  LOOM_GRID_STRIDE(i, N * Vp) {
    const int64_t n = i / Vp, v = i % Vp;
    if (v >= V) {
      dlogits16[i] = 0;
      continue;
    }
    const float hit = v0 + v == targets[n] ? 1.0f : 0.0f;
    dlogits16[i] = cuda::narrow16(dloss[n] * (expf(logits[i] - lse[n]) - hit), bf16);
  }
}

template <typename T>
__global__ void k_vocab_stats(T* mx, T* target, const T* logits, const int32_t* targets, int64_t V,
                              int64_t Vp, int64_t v0) {
  __shared__ T sh[32];
  const int64_t n = blockIdx.x;
  const T* row = logits + n * Vp;
  T m = T(-INFINITY);
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = max(m, row[v]);
  m = cuda::block_max(m, sh);
  if (threadIdx.x == 0) {
    mx[n] = m;
    const int64_t t = targets[n] - v0;
    target[n] = t >= 0 && t < Vp ? row[t] : T(0);
  }
}

template <typename T>
__global__ void k_vocab_sum_exp(T* sum, const T* logits, const T* mx, int64_t V, int64_t Vp) {
  __shared__ double sh[32];
  const int64_t n = blockIdx.x;
  double s = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
    s += exp(double(logits[n * Vp + v]) - double(mx[n]));
  s = cuda::block_sum(s, sh);
  if (threadIdx.x == 0) sum[n] = T(s);
}

template <typename T>
__global__ void k_encoder_forward(T* out, const int32_t* tokens, DevWeight<T> wte, DevWeight<T> wpe,
                                  int64_t Tn, int64_t C, const int32_t* pos, int64_t n) {
  LOOM_GRID_STRIDE(i, n) {
    const int64_t bt = i / C, c = i % C, t = bt % Tn;
    const int64_t p = pos ? int64_t{pos[t]} : t;
    out[i] = T(double(wte.at(int64_t{tokens[bt]} * C + c)) + double(wpe.at(p * C + c)));
  }
}

// Rows grouped by destination (a CSR from the host): block g adds the sum
// of its rows of src (in order) into dst row dest[g] once.
template <typename T>
__global__ void k_grouped_rows_add(T* dst, const T* src, const int32_t* dest,
                                   const int32_t* offsets, const int32_t* rows, int64_t C) {
  const int64_t g = blockIdx.x;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    T acc = 0;
    for (int32_t k = offsets[g]; k < offsets[g + 1]; ++k) acc += src[int64_t{rows[k]} * C + c];
    dst[int64_t{dest[g]} * C + c] += acc;
  }
}

// dst[key] += the rows whose key it is: keys (n) per source row, -1 skips.
template <typename T>
void grouped_rows_add(T* dst, const T* src, const std::vector<int32_t>& keys, int64_t C) {
  std::map<int32_t, std::vector<int32_t>> groups;
  for (size_t r = 0; r < keys.size(); ++r)
    if (keys[r] >= 0) groups[keys[r]].push_back(static_cast<int32_t>(r));
  if (groups.empty() || C == 0) return;
  std::vector<int32_t> dest, offsets{0}, rows;
  for (const auto& [k, rs] : groups) {
    dest.push_back(k);
    rows.insert(rows.end(), rs.begin(), rs.end());
    offsets.push_back(static_cast<int32_t>(rows.size()));
  }
  // The groups to the device by copies of their own (fresh host vectors
  // are not registered: they may share a page with a caller's buffer).
  auto upload = [](const std::vector<int32_t>& v, Scratch& d) {
    d = Scratch(sizeof(int32_t) * v.size());
    LOOM_CUDA_CHECK(cudaMemcpyAsync(d.as<int32_t>(), v.data(), sizeof(int32_t) * v.size(),
                                    cudaMemcpyHostToDevice, context().stream));
  };
  Scratch d_dest, d_off, d_rows;
  upload(dest, d_dest);
  upload(offsets, d_off);
  upload(rows, d_rows);
  k_grouped_rows_add<T><<<static_cast<unsigned>(dest.size()), kThreads, 0, context().stream>>>(
      dst, src, d_dest.as<int32_t>(), d_off.as<int32_t>(), d_rows.as<int32_t>(), C);
  LOOM_CUDA_LAUNCHED();
  // The host vectors stay alive until the copies are done.
  LOOM_CUDA_CHECK(cudaStreamSynchronize(context().stream));
}

template <typename T>
__global__ void k_embedding_lookup(T* out, const int32_t* tokens, DevWeight<T> wte, int64_t C,
                                   int64_t v0, int64_t v1, int64_t n) {
  LOOM_GRID_STRIDE(i, n) {
    const int64_t r = i / C, c = i % C, tok = tokens[r];
    out[i] = tok >= v0 && tok < v1 ? wte.at((tok - v0) * C + c) : T(0);
  }
}

template <typename T>
__global__ void k_add_positions(T* out, DevWeight<T> wpe, int64_t Tn, int64_t C, int64_t row0,
                                const int32_t* pos, int64_t n) {
  LOOM_GRID_STRIDE(i, n) {
    const int64_t r = i / C, c = i % C, local = (row0 + r) % Tn;
    const int64_t t = pos ? int64_t{pos[local]} : local;
    out[i] += wpe.at(t * C + c);
  }
}

struct AdamDev {
  double lr, b1, b2, eps, wd, bc1, bc2;
};
AdamDev adam_dev(const AdamWParams& hp) {
  return {hp.lr,
          hp.beta1,
          hp.beta2,
          hp.eps,
          hp.weight_decay,
          1 - std::pow(hp.beta1, double(hp.step)),
          1 - std::pow(hp.beta2, double(hp.step))};
}
__device__ __forceinline__ void adam_element(double& p, double g, double& m, double& v,
                                             const AdamDev& a) {
  m = a.b1 * m + (1 - a.b1) * g;
  v = a.b2 * v + (1 - a.b2) * g * g;
  p -= a.lr * (m / a.bc1 / (sqrt(v / a.bc2) + a.eps) + a.wd * p);
}

template <typename T>
__global__ void k_adamw(T* params, const T* grads, T* m, T* v, int64_t n, AdamDev a) {
  LOOM_GRID_STRIDE(i, n) {
    double p = params[i], mi = m[i], vi = v[i];
    adam_element(p, double(grads[i]), mi, vi, a);
    params[i] = T(p), m[i] = T(mi), v[i] = T(vi);
  }
}

__global__ void k_adamw_16(float* master, const uint16_t* grads, float grad_scale, float* m,
                           float* v, uint16_t* params, int64_t n, bool bf16, AdamDev a) {
  LOOM_GRID_STRIDE(i, n) {
    double p = master[i], mi = m[i], vi = v[i];
    adam_element(p, double(cuda::widen16(grads[i], bf16)) * double(grad_scale), mi, vi, a);
    master[i] = float(p), m[i] = float(mi), v[i] = float(vi);
    params[i] = cuda::narrow16(master[i], bf16);
  }
}

// partial[k] = the sum of squares of block k's kSumChunk elements, in double.
constexpr int64_t kSumChunk = 8192;
template <typename T>
__global__ void k_sum_squares(double* partial, const T* x, const uint16_t* x16, bool bf16,
                              int64_t n) {
  __shared__ double sh[32];
  const int64_t i0 = blockIdx.x * kSumChunk, i1 = min(n, i0 + kSumChunk);
  double s = 0;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const double v = x16 != nullptr ? double(cuda::widen16(x16[i], bf16)) : double(x[i]);
    s += v * v;
  }
  s = cuda::block_sum(s, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
template <typename T>
double sum_squares_dev(const T* x, const uint16_t* x16, bool bf16, int64_t n) {
  if (n == 0) return 0;
  const int64_t blocks = (n + kSumChunk - 1) / kSumChunk;
  Scratch partial(sizeof(double) * static_cast<size_t>(blocks));
  k_sum_squares<T><<<static_cast<unsigned>(blocks), kThreads, 0, context().stream>>>(
      partial.as<double>(), x, x16, bf16, n);
  LOOM_CUDA_LAUNCHED();
  std::vector<double> h(static_cast<size_t>(blocks));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(h.data(), partial.as<double>(), sizeof(double) * h.size(),
                                  cudaMemcpyDeviceToHost, context().stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(context().stream));
  double s = 0;
  for (double v : h) s += v;
  return s;
}

template <typename T>
__global__ void k_scale(T* x, int64_t n, T s) {
  LOOM_GRID_STRIDE(i, n) x[i] *= s;
}
__global__ void k_scale_16(uint16_t* x, int64_t n, float s, bool bf16) {
  LOOM_GRID_STRIDE(i, n) x[i] = cuda::narrow16(cuda::widen16(x[i], bf16) * s, bf16);
}
__global__ void k_widen_16(const uint16_t* x, float* out, int64_t n, bool bf16) {
  LOOM_GRID_STRIDE(i, n) out[i] = cuda::widen16(x[i], bf16);
}
__global__ void k_accumulate_16(const float* x, const uint16_t* x16, float scale, uint16_t* acc,
                                int64_t n, bool bf16) {
  LOOM_GRID_STRIDE(i, n) {
    const float xi = x16 != nullptr ? cuda::widen16(x16[i], bf16) : x[i];
    acc[i] = cuda::narrow16(cuda::widen16(acc[i], bf16) + xi * scale, bf16);
  }
}
__global__ void k_nonfinite_16(const uint16_t* x, int64_t n, bool bf16, int* flag) {
  LOOM_GRID_STRIDE(i, n) if (!isfinite(cuda::widen16(x[i], bf16)))* flag = 1;
}
template <typename T>
__global__ void k_fill(T* x, int64_t n, T value) {
  LOOM_GRID_STRIDE(i, n) x[i] = value;
}
template <typename T>
__global__ void k_axpy(T* y, T a, const T* x, int64_t n) {
  LOOM_GRID_STRIDE(i, n) y[i] += a * x[i];
}

}  // namespace

// ---- the backend ----------------------------------------------------------------------

template <typename T>
CudaBackend<T>::CudaBackend(CudaGemmConfig g) : g_(g) {
  (void)context();
  if constexpr (!std::is_same_v<T, float>) g_.inputs = DType::kF32;
}

template <typename T>
std::string CudaBackend<T>::name() const {
  std::string s = "cuda (" + cuda_device_description(context().device) + ", cuBLASLt";
  if (g_.inputs != DType::kF32)
    s += std::string(", ") + std::string(dtype_name(g_.inputs)) + " inputs";
  if (g_.tf32) s += ", tf32";
  return s + ")";
}

template <typename T>
bool CudaBackend<T>::supports(Op op) const {
  return std::is_same_v<T, float> || !is_16bit_op(op);
}

template <typename T>
Buffer CudaBackend<T>::alloc(size_t bytes, MemCategory category, bool zeroed) const {
  if (bytes == 0) return Buffer::adopt(nullptr, 0, category, Device::kCuda, nullptr);
  const cuda::Context& ctx = context();
  // Managed memory may be asked for beyond what the card holds (pages
  // would migrate to and fro, or the device stall): refused instead.
  size_t free_bytes = 0, total_bytes = 0;
  LOOM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  LOOM_CHECK(bytes <= free_bytes,
             "out of device memory: {} bytes for {} with {} of {} free on {} (a smaller "
             "micro-batch, activation checkpointing or ZeRO shrink the run)",
             bytes, mem_category_name(category), free_bytes, total_bytes,
             cuda_device_description(ctx.device));
  void* p = nullptr;
  const cudaError_t e = cudaMallocManaged(&p, bytes);
  LOOM_CHECK(e == cudaSuccess, "out of device memory allocating {} bytes for {} on {}: {}", bytes,
             mem_category_name(category), cuda_device_description(ctx.device),
             cudaGetErrorString(e));
  cudaMemLocation loc{};
  loc.type = cudaMemLocationTypeDevice;
  loc.id = ctx.device;
  LOOM_CUDA_CHECK(cudaMemAdvise(p, bytes, cudaMemAdviseSetPreferredLocation, loc));
  if (zeroed) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, ctx.stream));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  }
  return Buffer::adopt(p, bytes, category, Device::kCuda, [](void* q) { cudaFree(q); });
}

template <typename T>
void CudaBackend<T>::order_after(const DeviceEvent& e) const {
  // Every operation synchronises its stream, so waiting on the host orders
  // the next one after the event.
  e.synchronize();
}

namespace {

// C = alpha op(A) op(B) + beta C with B a weight, on the device pointers of
// `args`; 16-bit inputs when the weight is 16-bit or the backend asks.
template <typename T>
void weight_gemm(const CudaGemmConfig& g, Args& args, bool ta, bool tb, int64_t M, int64_t N,
                 int64_t K, T alpha, const T* A, int64_t lda, const Weight<T>& B, int64_t ldb,
                 T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const int64_t ea = extent(ta ? K : M, ta ? M : K, lda), eb = extent(tb ? N : K, tb ? K : N, ldb);
  T* c = args.inout(C, extent(M, N, ldc));
  if (K == 0) {  // op(A) op(B) is zero: C = beta C
    if (beta != T(1)) launch(k_scale_rows<T>, M * N, c, M, N, ldc, beta);
    return;
  }
  const T* a = args.in(A, ea);
  DType type = DType::kF32;
  if constexpr (std::is_same_v<T, float>) type = B.w16 != nullptr ? B.t : g.inputs;
  if (type == DType::kF32) {
    LOOM_CHECK(B.w16 == nullptr, "16-bit weights need f32 layers");
    cuda::lt_gemm<T>(ta, tb, M, N, K, alpha, a, lda, args.in(B.data, eb), ldb, beta, c, ldc,
                     DType::kF32, g.tf32);
    return;
  }
  const bool bf16 = type == DType::kBF16;
  Scratch a16(sizeof(uint16_t) * static_cast<size_t>(ea));
  launch(k_to16<T>, ea, a16.as<uint16_t>(), a, ea, bf16);
  Scratch b16;
  const void* b = nullptr;
  if (B.w16 != nullptr) {
    b = args.in(B.w16, eb);
  } else {
    b16 = Scratch(sizeof(uint16_t) * static_cast<size_t>(eb));
    launch(k_to16<T>, eb, b16.as<uint16_t>(), args.in(B.data, eb), eb, bf16);
    b = b16.as<uint16_t>();
  }
  cuda::lt_gemm<T>(ta, tb, M, N, K, alpha, a16.as<uint16_t>(), lda, b, ldb, beta, c, ldc, type,
                   false);
}

}  // namespace

template <typename T>
void CudaBackend<T>::gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
                          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) const {
  Args args;
  weight_gemm<T>(g_, args, ta, tb, M, N, K, alpha, A, lda, Weight<T>(B), ldb, beta, C, ldc);
  args.finish();
}

template <typename T>
void CudaBackend<T>::matmul_forward(T* out, InputArg<T> input, WeightArg<T> weight, const T* bias,
                                    int64_t N, int64_t C, int64_t OC) const {
  LOOM_CHECK(input.r16 == nullptr, "backend {} takes no bf16 input twins", name());
  const T* inp = input.data;
  Args args;
  T* o = args.inout(out, N * OC);
  if (bias != nullptr) launch(k_rows_from<T>, N * OC, o, args.in(bias, OC), N, OC);
  weight_gemm<T>(g_, args, false, false, N, OC, C, T(1), inp, C, weight, OC, bias ? T(1) : T(0), o,
                 OC);
  args.finish();
}

template <typename T>
void CudaBackend<T>::matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout,
                                     InputArg<T> input, WeightArg<T> weight, int64_t N, int64_t C,
                                     int64_t OC, GradWrite dinp_write) const {
  LOOM_CHECK(input.r16 == nullptr, "backend {} takes no bf16 input twins", name());
  const T* inp = input.data;
  Args args;
  const T* dy = args.in(dout, N * OC);
  if (dinp != nullptr)
    weight_gemm<T>(g_, args, false, true, N, C, OC, T(1), dy, OC, weight, OC,
                   dinp_write == GradWrite::kSet ? T(0) : T(1), dinp, C);
  if (dweight != nullptr)
    weight_gemm<T>(g_, args, true, false, C, OC, N, T(1), inp, C, Weight<T>(dy), OC, T(1), dweight,
                   OC);
  if (dbias != nullptr) colsum_add<T>(args.inout(dbias, OC), dy, N, OC);
  args.finish();
}

template <typename T>
void CudaBackend<T>::matmul_nt_forward(T* out, const T* inp, WeightArg<T> weight, int64_t N,
                                       int64_t C, int64_t V) const {
  Args args;
  weight_gemm<T>(g_, args, false, true, N, V, C, T(1), inp, C, weight, C, T(0), out, V);
  args.finish();
}

template <typename T>
void CudaBackend<T>::matmul_nt_backward(T* dinp, T* dweight, InputArg<T> dout, const T* inp,
                                        WeightArg<T> weight, int64_t N, int64_t C,
                                        int64_t V) const {
  LOOM_CHECK(dout.r16 == nullptr, "backend {} takes no bf16 input twins", name());
  Args args;
  const T* dy = args.in(dout.data, N * V);
  if (dinp != nullptr)
    weight_gemm<T>(g_, args, false, false, N, C, V, T(1), dy, V, weight, C, T(1), dinp, C);
  if (dweight != nullptr)
    weight_gemm<T>(g_, args, true, false, V, C, N, T(1), dy, V, Weight<T>(inp), C, T(1), dweight,
                   C);
  args.finish();
}

template <typename T>
void CudaBackend<T>::layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight,
                                       const T* bias, int64_t N, int64_t C) const {
  if (N == 0) return;
  Args args;
  constexpr int rows = kThreads / 32;
  k_layernorm_forward<T>
      <<<static_cast<unsigned>((N + rows - 1) / rows), kThreads, 0, context().stream>>>(
          StoreAs<T>{args.inout(out, N * C)}, args.inout(mean, N), args.inout(rstd, N),
          args.in(inp, N * C), args.in(weight, C), args.in(bias, C), N, C);
  LOOM_CUDA_LAUNCHED();
  args.finish();
}

template <typename T>
void CudaBackend<T>::layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp,
                                        const T* weight, const T* mean, const T* rstd, int64_t N,
                                        int64_t C) const {
  if (N == 0) return;
  Args args;
  const T* dy = args.in(dout, N * C);
  const T* x = args.in(inp, N * C);
  const T* m = args.in(mean, N);
  const T* r = args.in(rstd, N);
  if (dweight != nullptr) {
    const int64_t chunks = (N + kRowChunk - 1) / kRowChunk;
    Scratch pw(sizeof(T) * static_cast<size_t>(chunks * C)),
        pb(sizeof(T) * static_cast<size_t>(chunks * C));
    const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads),
                    static_cast<unsigned>(chunks));
    k_layernorm_dparams<T>
        <<<grid, kThreads, 0, context().stream>>>(pw.as<T>(), pb.as<T>(), dy, x, m, r, N, C);
    LOOM_CUDA_LAUNCHED();
    launch(k_colsum_final<T>, C, args.inout(dweight, C), static_cast<const T*>(pw.as<T>()), chunks,
           C);
    launch(k_colsum_final<T>, C, args.inout(dbias, C), static_cast<const T*>(pb.as<T>()), chunks,
           C);
  }
  if (dinp != nullptr) {
    constexpr int rows = kThreads / 32;
    k_layernorm_dinp<T>
        <<<static_cast<unsigned>((N + rows - 1) / rows), kThreads, 0, context().stream>>>(
            args.inout(dinp, N * C), dy, x, args.in(weight, C), m, r, N, C);
    LOOM_CUDA_LAUNCHED();
  }
  args.finish();
}

template <typename T>
void CudaBackend<T>::gelu_forward(T* out, const T* inp, int64_t n) const {
  Args args;
  launch(k_gelu_forward<T>, n, args.inout(out, n), args.in(inp, n), n);
  args.finish();
}
template <typename T>
void CudaBackend<T>::gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) const {
  Args args;
  launch(k_gelu_backward<T>, n, args.inout(dinp, n), args.in(inp, n), args.in(dout, n), n);
  args.finish();
}
template <typename T>
void CudaBackend<T>::residual_forward(T* out, const T* a, const T* b, int64_t n) const {
  Args args;
  launch(k_residual<T>, n, args.inout(out, n), args.in(a, n), args.in(b, n), n);
  args.finish();
}
template <typename T>
void CudaBackend<T>::add(T* dst, const T* src, int64_t n) const {
  Args args;
  launch(k_add<T>, n, args.inout(dst, n), args.in(src, n), n);
  args.finish();
}
template <typename T>
void CudaBackend<T>::bias_add(T* y, const T* bias, int64_t N, int64_t C) const {
  Args args;
  launch(k_bias_add<T>, N * C, args.inout(y, N * C), args.in(bias, C), N, C);
  args.finish();
}
template <typename T>
void CudaBackend<T>::dropout(T* x, const DropoutSpec& spec, int64_t Tn, int64_t C, int64_t row0,
                             int64_t n) const {
  if (!spec.active()) return;
  Args args;
  const cuda::DeviceDropout d = cuda::device_dropout(spec, args, Tn);
  launch(k_dropout<T>, n * C, args.inout(x, n * C), d, Tn, C, row0, n);
  args.finish();
}

template <typename T>
void CudaBackend<T>::dropout_residual(T* out, const T* x, const T* residual,
                                      const DropoutSpec& spec, int64_t Tn, int64_t C, int64_t row0,
                                      int64_t n) const {
  if (!spec.active()) {
    if (residual != nullptr)
      residual_forward(out, x, residual, n * C);
    else if (out != x)
      copy(out, x, n * C);
    return;
  }
  Args args;
  const cuda::DeviceDropout d = cuda::device_dropout(spec, args, Tn);
  T* o = args.inout(out, n * C);
  const T* xs = out == x ? o : args.in(x, n * C);
  const T* r = residual != nullptr ? args.in(residual, n * C) : nullptr;
  launch(k_dropout_residual<T>, n * C, o, xs, r, d, Tn, C, row0, n);
  args.finish();
}

template <typename T>
void CudaBackend<T>::cross_entropy_forward(T* losses, T* lse, const T* logits,
                                           const int32_t* targets, int64_t N, int64_t V,
                                           int64_t Vp) const {
  if (N == 0) return;
  Args args;
  k_ce_forward<T><<<static_cast<unsigned>(N), kThreads, 0, context().stream>>>(
      args.inout(losses, N), args.inout(lse, N), args.in(logits, N * Vp), args.in(targets, N), V,
      Vp);
  LOOM_CUDA_LAUNCHED();
  args.finish();
}

template <typename T>
void CudaBackend<T>::cross_entropy_backward(T* logits, const T* lse, const int32_t* targets,
                                            const T* dloss, int64_t N, int64_t V, int64_t Vp,
                                            int64_t v0) const {
  Args args;
  launch(k_ce_backward<T>, N * Vp, args.inout(logits, N * Vp), args.in(lse, N), args.in(targets, N),
         args.in(dloss, N), N, V, Vp, v0);
  args.finish();
}

template <typename T>
void CudaBackend<T>::cross_entropy_backward_16(uint16_t* dlogits16, const float* logits,
                                               const float* lse, const int32_t* targets,
                                               const float* dloss, int64_t N, int64_t V, int64_t Vp,
                                               int64_t v0, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kCrossEntropyBackward16);
  check_16(t);
  Args args;
  launch(k_ce_backward_16, N * Vp, args.inout(dlogits16, N * Vp), args.in(logits, N * Vp),
         args.in(lse, N), args.in(targets, N), args.in(dloss, N), N, V, Vp, v0, t == DType::kBF16);
  args.finish();
}

template <typename T>
void CudaBackend<T>::vocab_logit_stats(T* mx, T* target, const T* logits, const int32_t* targets,
                                       int64_t N, int64_t V, int64_t Vp, int64_t v0) const {
  if (N == 0) return;
  Args args;
  k_vocab_stats<T><<<static_cast<unsigned>(N), kThreads, 0, context().stream>>>(
      args.inout(mx, N), args.inout(target, N), args.in(logits, N * Vp), args.in(targets, N), V, Vp,
      v0);
  LOOM_CUDA_LAUNCHED();
  args.finish();
}

template <typename T>
void CudaBackend<T>::vocab_sum_exp(T* sum, const T* logits, const T* mx, int64_t N, int64_t V,
                                   int64_t Vp) const {
  if (N == 0) return;
  Args args;
  k_vocab_sum_exp<T><<<static_cast<unsigned>(N), kThreads, 0, context().stream>>>(
      args.inout(sum, N), args.in(logits, N * Vp), args.in(mx, N), V, Vp);
  LOOM_CUDA_LAUNCHED();
  args.finish();
}

template <typename T>
void CudaBackend<T>::encoder_forward(T* out, const int32_t* tokens, WeightArg<T> wte,
                                     WeightArg<T> wpe, int64_t B, int64_t Tn, int64_t C,
                                     const int32_t* pos) const {
  const int64_t n = B * Tn * C;
  if (n == 0) return;
  // The rows of wte and wpe the lookup reads (for staging a host weight).
  const std::vector<int32_t> tok = host_ints(tokens, B * Tn);
  const std::vector<int32_t> p = pos ? host_ints(pos, Tn) : std::vector<int32_t>{};
  const int64_t v_rows = *std::max_element(tok.begin(), tok.end()) + int64_t{1};
  const int64_t p_rows = pos ? *std::max_element(p.begin(), p.end()) + int64_t{1} : Tn;
  Args args;
  launch(k_encoder_forward<T>, n, args.inout(out, n), args.in(tokens, B * Tn),
         dev_weight(wte, v_rows * C, args), dev_weight(wpe, p_rows * C, args), Tn, C,
         args.in(pos, Tn), n);
  args.finish();
}

template <typename T>
void CudaBackend<T>::encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens,
                                      int64_t B, int64_t Tn, int64_t C, int64_t v0, int64_t v1,
                                      const int32_t* pos) const {
  if (B * Tn == 0) return;
  const std::vector<int32_t> tok = host_ints(tokens, B * Tn);
  const std::vector<int32_t> p = pos ? host_ints(pos, Tn) : std::vector<int32_t>{};
  std::vector<int32_t> wte_rows(tok.size()), wpe_rows(tok.size());
  int32_t p_max = 0;
  for (size_t r = 0; r < tok.size(); ++r) {
    const int64_t t = static_cast<int64_t>(r) % Tn;
    wpe_rows[r] = pos ? p[static_cast<size_t>(t)] : static_cast<int32_t>(t);
    p_max = std::max(p_max, wpe_rows[r]);
    wte_rows[r] = tok[r] >= v0 && tok[r] < v1 ? static_cast<int32_t>(tok[r] - v0) : -1;
  }
  Args args;
  const T* dy = args.in(dout, B * Tn * C);
  grouped_rows_add<T>(args.inout(dwpe, (int64_t{p_max} + 1) * C), dy, wpe_rows, C);
  grouped_rows_add<T>(args.inout(dwte, (v1 - v0) * C), dy, wte_rows, C);
  args.finish();
}

template <typename T>
void CudaBackend<T>::embedding_lookup(T* out, const int32_t* tokens, WeightArg<T> wte, int64_t N,
                                      int64_t C, int64_t v0, int64_t v1) const {
  if (N * C == 0) return;
  Args args;
  launch(k_embedding_lookup<T>, N * C, args.inout(out, N * C), args.in(tokens, N),
         dev_weight(wte, (v1 - v0) * C, args), C, v0, v1, N * C);
  args.finish();
}

template <typename T>
void CudaBackend<T>::add_positions(T* out, WeightArg<T> wpe, int64_t Tn, int64_t C, int64_t row0,
                                   int64_t n, const int32_t* pos) const {
  if (n * C == 0) return;
  int64_t rows = std::min(Tn, row0 % Tn + n);
  if (pos != nullptr) {
    const std::vector<int32_t> p = host_ints(pos, Tn);
    rows = *std::max_element(p.begin(), p.end()) + int64_t{1};
  }
  Args args;
  launch(k_add_positions<T>, n * C, args.inout(out, n * C), dev_weight(wpe, rows * C, args), Tn, C,
         row0, args.in(pos, Tn), n * C);
  args.finish();
}

template <typename T>
void CudaBackend<T>::adamw(T* params, const T* grads, T* m, T* v, int64_t n,
                           const AdamWParams& hp) const {
  Args args;
  launch(k_adamw<T>, n, args.inout(params, n), args.in(grads, n), args.inout(m, n),
         args.inout(v, n), n, adam_dev(hp));
  args.finish();
}

template <typename T>
void CudaBackend<T>::adamw_16(float* master, const uint16_t* grads, float grad_scale, float* m,
                              float* v, uint16_t* params, int64_t n, DType t,
                              const AdamWParams& hp) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kAdamW16);
  check_16(t);
  Args args;
  launch(k_adamw_16, n, args.inout(master, n), args.in(grads, n), grad_scale, args.inout(m, n),
         args.inout(v, n), args.inout(params, n), n, t == DType::kBF16, adam_dev(hp));
  args.finish();
}

template <typename T>
double CudaBackend<T>::sum_squares(const T* x, int64_t n) const {
  Args args;
  const double s = sum_squares_dev<T>(args.in(x, n), nullptr, true, n);
  args.finish();
  return s;
}

template <typename T>
double CudaBackend<T>::sum_squares_16(const uint16_t* x, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kSumSquares16);
  check_16(t);
  Args args;
  const double s = sum_squares_dev<float>(nullptr, args.in(x, n), t == DType::kBF16, n);
  args.finish();
  return s;
}

template <typename T>
void CudaBackend<T>::scale(T* x, int64_t n, T s) const {
  Args args;
  launch(k_scale<T>, n, args.inout(x, n), n, s);
  args.finish();
}

template <typename T>
void CudaBackend<T>::scale_16(uint16_t* x, int64_t n, float s, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kScale16);
  check_16(t);
  Args args;
  launch(k_scale_16, n, args.inout(x, n), n, s, t == DType::kBF16);
  args.finish();
}

template <typename T>
void CudaBackend<T>::layernorm_forward_16(uint16_t* out16, float* mean, float* rstd,
                                          const float* inp, const float* weight, const float* bias,
                                          int64_t N, int64_t C, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kLayerNormForward16);
  check_16(t);
  if (N == 0) return;
  Args args;
  constexpr int rows = kThreads / 32;
  k_layernorm_forward<float>
      <<<static_cast<unsigned>((N + rows - 1) / rows), kThreads, 0, context().stream>>>(
          StoreRounded{args.inout(out16, N * C), t == DType::kBF16}, args.inout(mean, N),
          args.inout(rstd, N), args.in(inp, N * C), args.in(weight, C), args.in(bias, C), N, C);
  LOOM_CUDA_LAUNCHED();
  args.finish();
}

template <typename T>
void CudaBackend<T>::gelu_forward_16(uint16_t* out16, const float* inp, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kGeluForward16);
  check_16(t);
  Args args;
  launch(k_gelu_forward_16, n, args.inout(out16, n), args.in(inp, n), n, t == DType::kBF16);
  args.finish();
}
template <typename T>
void CudaBackend<T>::round_16(const float* x, uint16_t* out, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kRound16);
  check_16(t);
  Args args;
  launch(k_to16<float>, n, args.inout(out, n), args.in(x, n), n, t == DType::kBF16);
  args.finish();
}

template <typename T>
void CudaBackend<T>::widen_16(const uint16_t* x, float* out, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kWiden16);
  check_16(t);
  Args args;
  launch(k_widen_16, n, args.in(x, n), args.inout(out, n), n, t == DType::kBF16);
  args.finish();
}

template <typename T>
void CudaBackend<T>::accumulate_16(const float* x, const uint16_t* x16, float scale, uint16_t* acc,
                                   int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kAccumulate16);
  check_16(t);
  Args args;
  launch(k_accumulate_16, n, args.in(x, n), args.in(x16, n), scale, args.inout(acc, n), n,
         t == DType::kBF16);
  args.finish();
}

template <typename T>
bool CudaBackend<T>::nonfinite_16(const uint16_t* x, int64_t n, DType t) const {
  if constexpr (!std::is_same_v<T, float>) this->unsupported(Op::kNonfinite16);
  check_16(t);
  Args args;
  Scratch d_flag(sizeof(int));
  LOOM_CUDA_CHECK(cudaMemsetAsync(d_flag.as<int>(), 0, sizeof(int), context().stream));
  launch(k_nonfinite_16, n, args.in(x, n), n, t == DType::kBF16, d_flag.as<int>());
  int flag = 0;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&flag, d_flag.as<int>(), sizeof(int), cudaMemcpyDeviceToHost,
                                  context().stream));
  args.finish();
  return flag != 0;
}

template <typename T>
void CudaBackend<T>::copy(T* dst, const T* src, int64_t n) const {
  if (n == 0) return;
  Args args;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(args.inout(dst, n), args.in(src, n),
                                  sizeof(T) * static_cast<size_t>(n), cudaMemcpyDefault,
                                  context().stream));
  args.finish();
}

template <typename T>
void CudaBackend<T>::fill(T* x, int64_t n, T value) const {
  Args args;
  launch(k_fill<T>, n, args.inout(x, n), n, value);
  args.finish();
}

template <typename T>
void CudaBackend<T>::axpy(T* y, T a, const T* x, int64_t n) const {
  Args args;
  launch(k_axpy<T>, n, args.inout(y, n), a, args.in(x, n), n);
  args.finish();
}

template class CudaBackend<float>;
template class CudaBackend<double>;

}  // namespace loom
