// The CUDA backend's attention. Whole sequences: q, k and v gathered per
// head, scores by a batched cuBLASLt GEMM over (batch x heads), a causal
// softmax kernel that writes the log-sum-exp and the dropped-out
// probabilities, and batched GEMMs for the output and each gradient (the
// scores' gradient from a row kernel: dS = P (keep * dP - D)). Context-
// parallel chunk pairs: row kernels, one block per query row (forward,
// dq) or per key row (dk, dv), so no two blocks add into one element.
#include <cmath>
#include <type_traits>

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

// (b, t, [q | k | v], h, d) -> q, k, v each (b, h, t, d).
template <typename T>
__global__ void k_split_heads(T* q, T* k, T* v, const T* qkv, int64_t B, int64_t Tn, int64_t NH,
                              int64_t hs) {
  const int64_t C = NH * hs;
  LOOM_GRID_STRIDE(i, B * NH * Tn * hs) {
    const int64_t d = i % hs, t = (i / hs) % Tn, h = (i / (hs * Tn)) % NH, b = i / (hs * Tn * NH);
    const int64_t src = (b * Tn + t) * 3 * C + h * hs + d;
    q[i] = qkv[src];
    k[i] = qkv[src + C];
    v[i] = qkv[src + 2 * C];
  }
}
// (b, t, h, d) -> (b, h, t, d).
template <typename T>
__global__ void k_to_heads(T* x, const T* y, int64_t B, int64_t Tn, int64_t NH, int64_t hs) {
  LOOM_GRID_STRIDE(i, B * NH * Tn * hs) {
    const int64_t d = i % hs, t = (i / hs) % Tn, h = (i / (hs * Tn)) % NH, b = i / (hs * Tn * NH);
    x[i] = y[(b * Tn + t) * NH * hs + h * hs + d];
  }
}
// out (b, t, h, d) = o (b, h, t, d).
template <typename T>
__global__ void k_from_heads(T* out, const T* o, int64_t B, int64_t Tn, int64_t NH, int64_t hs) {
  LOOM_GRID_STRIDE(i, B * NH * Tn * hs) {
    const int64_t d = i % hs, t = (i / hs) % Tn, h = (i / (hs * Tn)) % NH, b = i / (hs * Tn * NH);
    out[(b * Tn + t) * NH * hs + h * hs + d] = o[i];
  }
}
// dqkv (b, t, [q | k | v], h, d) = dq, dk, dv (b, h, t, d).
template <typename T>
__global__ void k_merge_heads(T* dqkv, const T* dq, const T* dk, const T* dv, int64_t B,
                              int64_t Tn, int64_t NH, int64_t hs) {
  const int64_t C = NH * hs;
  LOOM_GRID_STRIDE(i, B * NH * Tn * hs) {
    const int64_t d = i % hs, t = (i / hs) % Tn, h = (i / (hs * Tn)) % NH, b = i / (hs * Tn * NH);
    const int64_t dst = (b * Tn + t) * 3 * C + h * hs + d;
    dqkv[dst] = dq[i];
    dqkv[dst + C] = dk[i];
    dqkv[dst + 2 * C] = dv[i];
  }
}

// One block per score row (bh, i): scores s (already scaled) -> lse and,
// in place, p_j keep_j for j <= i, 0 after.
template <typename T>
__global__ void k_causal_softmax(T* s, T* lse, int64_t NH, int64_t Tn, cuda::DeviceDropout d) {
  __shared__ T sh_t[32];
  __shared__ double sh_d[32];
  const int64_t row = blockIdx.x, i = row % Tn, bh = row / Tn;
  const int64_t b = bh / NH, h = bh % NH;
  T* r = s + row * Tn;
  T m = T(-INFINITY);
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) m = max(m, r[j]);
  m = cuda::block_max(m, sh_t);
  double sum = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) sum += exp(double(r[j]) - double(m));
  sum = cuda::block_sum(sum, sh_d);
  const T l = T(double(m) + log(sum));
  if (threadIdx.x == 0) lse[row] = l;
  for (int64_t j = threadIdx.x; j < Tn; j += blockDim.x)
    r[j] = j <= i ? exp(r[j] - l) * cuda::keep_of<T>(d, d.sample0 + static_cast<uint64_t>(b),
                                                     d.site + static_cast<uint32_t>(h),
                                                     static_cast<uint32_t>(i), j)
                  : T(0);
}

// Backward, per element: p (in s, scaled scores on entry) = exp(s - lse)
// for j <= i else 0; pk = p keep.
template <typename T>
__global__ void k_probs_rows(T* s, T* pk, const T* lse, int64_t NH, int64_t Tn, int64_t rows,
                             cuda::DeviceDropout d) {
  LOOM_GRID_STRIDE(idx, rows * Tn) {
    const int64_t row = idx / Tn, j = idx % Tn, i = row % Tn, bh = row / Tn;
    const int64_t b = bh / NH, h = bh % NH;
    const T p = j <= i ? exp(s[idx] - lse[row]) : T(0);
    s[idx] = p;
    pk[idx] = j <= i ? p * cuda::keep_of<T>(d, d.sample0 + static_cast<uint64_t>(b),
                                            d.site + static_cast<uint32_t>(h),
                                            static_cast<uint32_t>(i), j)
                     : T(0);
  }
}

// One block per row: dp (in g, dO V^T on entry) -> dS = scale p (keep dp - D),
// D = sum_j p_j keep_j dp_j.
template <typename T>
__global__ void k_score_grad(T* g, const T* p, int64_t NH, int64_t Tn, T scale,
                             cuda::DeviceDropout d) {
  __shared__ T sh[32];
  const int64_t row = blockIdx.x, i = row % Tn, bh = row / Tn;
  const int64_t b = bh / NH, h = bh % NH;
  T* gr = g + row * Tn;
  const T* pr = p + row * Tn;
  auto keep = [&](int64_t j) {
    return cuda::keep_of<T>(d, d.sample0 + static_cast<uint64_t>(b),
                            d.site + static_cast<uint32_t>(h), static_cast<uint32_t>(i), j);
  };
  T D = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) D += pr[j] * keep(j) * gr[j];
  D = cuda::block_sum(D, sh);
  for (int64_t j = threadIdx.x; j < Tn; j += blockDim.x)
    gr[j] = j <= i ? scale * pr[j] * (keep(j) * gr[j] - D) : T(0);
}

// ---- chunk pairs (context parallelism) -----------------------------------------------

constexpr int kRowThreads = 128;
constexpr int kMaxPerThread = 4;  // head size up to 512

template <typename T>
__device__ T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Block (b, h, i): this chunk's keys for query i, merged into out and lse.
template <typename T>
__global__ void k_chunk_forward(T* out, T* lse, const T* q, const T* kv, AttentionChunk a,
                                cuda::DeviceDropout d) {
  __shared__ T sh[32];
  __shared__ T w[kRowThreads];
  const int64_t i = blockIdx.x % a.Tq, h = (blockIdx.x / a.Tq) % a.NH,
                b = blockIdx.x / (a.Tq * a.NH);
  const int64_t hs = a.C / a.NH;
  const int64_t n = min(a.Tk, a.q_pos + i - a.k_pos + 1);
  if (n <= 0) return;
  const T scale = T(1) / sqrt(T(hs));
  const T* qi = q + b * a.q_batch + i * a.q_row + h * hs;
  const T* kb = kv + b * a.kv_batch + h * hs;
  T m = T(-INFINITY);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    m = max(m, dot(qi, kb + j * a.kv_row, hs) * scale);
  m = cuda::block_max(m, sh);
  T s = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    s += exp(dot(qi, kb + j * a.kv_row, hs) * scale - m);
  s = cuda::block_sum(s, sh);
  const T lb = m + log(s);
  T acc[kMaxPerThread] = {};
  for (int64_t j0 = 0; j0 < n; j0 += blockDim.x) {
    const int64_t j = j0 + threadIdx.x;
    __syncthreads();
    w[threadIdx.x] = j < n ? exp(dot(qi, kb + j * a.kv_row, hs) * scale - lb) *
                                 cuda::keep_of<T>(d, d.sample0 + static_cast<uint64_t>(b),
                                                  d.site + static_cast<uint32_t>(h),
                                                  static_cast<uint32_t>(a.q_pos + i), a.k_pos + j)
                           : T(0);
    __syncthreads();
    const int64_t jn = min(int64_t{blockDim.x}, n - j0);
    for (int k = 0; k < kMaxPerThread; ++k) {
      const int64_t dd = threadIdx.x + k * int64_t{blockDim.x};
      if (dd >= hs) break;
      for (int64_t jj = 0; jj < jn; ++jj) acc[k] += w[jj] * kb[(j0 + jj) * a.kv_row + a.v_col + dd];
    }
  }
  T* li = lse + b * a.lse_batch + h * a.lse_head + i;
  const T lo = *li;
  const bool none = isinf(lo) && lo < 0;
  // log(e^lo + e^lb) without overflow: the larger one out front.
  const T big = max(lo, lb), small = min(lo, lb);
  const T ln = none ? lb : big + log1p(exp(small - big));
  const T wo = none ? T(0) : exp(lo - ln), wb = exp(lb - ln);
  T* o = out + b * a.o_batch + i * a.o_row + h * hs;
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int64_t dd = threadIdx.x + k * int64_t{blockDim.x};
    if (dd >= hs) break;
    o[dd] = o[dd] * wo + acc[k] * wb;
  }
  __syncthreads();
  if (threadIdx.x == 0) *li = ln;
}

// Block (b, h, i): Dv[b, h, i] = dO_i . O_i, and dq_i += this chunk's share.
template <typename T>
__global__ void k_chunk_dq(T* dq, T* Dv, const T* dout, const T* q, const T* kv, const T* out,
                           const T* lse, AttentionChunk a, cuda::DeviceDropout d) {
  __shared__ T sh[32];
  __shared__ T w[kRowThreads];
  const int64_t i = blockIdx.x % a.Tq, h = (blockIdx.x / a.Tq) % a.NH,
                b = blockIdx.x / (a.Tq * a.NH);
  const int64_t hs = a.C / a.NH;
  const T scale = T(1) / sqrt(T(hs));
  const T* qi = q + b * a.q_batch + i * a.q_row + h * hs;
  const T* g = dout + b * a.o_batch + i * a.o_row + h * hs;
  const T* oi = out + b * a.o_batch + i * a.o_row + h * hs;
  T D = 0;
  for (int64_t dd = threadIdx.x; dd < hs; dd += blockDim.x) D += g[dd] * oi[dd];
  D = cuda::block_sum(D, sh);
  if (threadIdx.x == 0) Dv[blockIdx.x] = D;
  const int64_t n = min(a.Tk, a.q_pos + i - a.k_pos + 1);
  if (n <= 0) return;
  const T l = lse[b * a.lse_batch + h * a.lse_head + i];
  const T* kb = kv + b * a.kv_batch + h * hs;
  T acc[kMaxPerThread] = {};
  for (int64_t j0 = 0; j0 < n; j0 += blockDim.x) {
    const int64_t j = j0 + threadIdx.x;
    __syncthreads();
    if (j < n) {
      const T* k = kb + j * a.kv_row;
      const T p = exp(dot(qi, k, hs) * scale - l);
      const T keep = cuda::keep_of<T>(d, d.sample0 + static_cast<uint64_t>(b),
                                      d.site + static_cast<uint32_t>(h),
                                      static_cast<uint32_t>(a.q_pos + i), a.k_pos + j);
      w[threadIdx.x] = p * (keep * dot(g, k + a.v_col, hs) - D);
    } else {
      w[threadIdx.x] = T(0);
    }
    __syncthreads();
    const int64_t jn = min(int64_t{blockDim.x}, n - j0);
    for (int k = 0; k < kMaxPerThread; ++k) {
      const int64_t dd = threadIdx.x + k * int64_t{blockDim.x};
      if (dd >= hs) break;
      for (int64_t jj = 0; jj < jn; ++jj) acc[k] += w[jj] * kb[(j0 + jj) * a.kv_row + dd];
    }
  }
  T* gq = dq + b * a.q_batch + i * a.q_row + h * hs;
  for (int k = 0; k < kMaxPerThread; ++k) {
    const int64_t dd = threadIdx.x + k * int64_t{blockDim.x};
    if (dd >= hs) break;
    gq[dd] += acc[k] * scale;
  }
}

// Block (b, h, j): dk_j and dv_j += over the queries of this chunk that see key j.
template <typename T>
__global__ void k_chunk_dkv(T* dkv, const T* Dv, const T* dout, const T* q, const T* kv,
                            const T* lse, AttentionChunk a, cuda::DeviceDropout d) {
  __shared__ T ws[kRowThreads];
  __shared__ T wp[kRowThreads];
  const int64_t j = blockIdx.x % a.Tk, h = (blockIdx.x / a.Tk) % a.NH,
                b = blockIdx.x / (a.Tk * a.NH);
  const int64_t hs = a.C / a.NH;
  const T scale = T(1) / sqrt(T(hs));
  const int64_t i0 = max(int64_t{0}, a.k_pos + j - a.q_pos);  // the first query that sees key j
  if (i0 >= a.Tq) return;
  const T* k = kv + b * a.kv_batch + j * a.kv_row + h * hs;
  const T* v = k + a.v_col;
  T acc_k[kMaxPerThread] = {}, acc_v[kMaxPerThread] = {};
  for (int64_t ib = i0; ib < a.Tq; ib += blockDim.x) {
    const int64_t i = ib + threadIdx.x;
    __syncthreads();
    if (i < a.Tq) {
      const T* qi = q + b * a.q_batch + i * a.q_row + h * hs;
      const T* g = dout + b * a.o_batch + i * a.o_row + h * hs;
      const T p = exp(dot(qi, k, hs) * scale - lse[b * a.lse_batch + h * a.lse_head + i]);
      const T keep = cuda::keep_of<T>(d, d.sample0 + static_cast<uint64_t>(b),
                                      d.site + static_cast<uint32_t>(h),
                                      static_cast<uint32_t>(a.q_pos + i), a.k_pos + j);
      const T D = Dv[(b * a.NH + h) * a.Tq + i];
      ws[threadIdx.x] = p * (keep * dot(g, v, hs) - D) * scale;
      wp[threadIdx.x] = p * keep;
    } else {
      ws[threadIdx.x] = wp[threadIdx.x] = T(0);
    }
    __syncthreads();
    const int64_t in = min(int64_t{blockDim.x}, a.Tq - ib);
    for (int kk = 0; kk < kMaxPerThread; ++kk) {
      const int64_t dd = threadIdx.x + kk * int64_t{blockDim.x};
      if (dd >= hs) break;
      for (int64_t ii = 0; ii < in; ++ii) {
        const int64_t row = ib + ii;
        acc_k[kk] += ws[ii] * q[b * a.q_batch + row * a.q_row + h * hs + dd];
        acc_v[kk] += wp[ii] * dout[b * a.o_batch + row * a.o_row + h * hs + dd];
      }
    }
  }
  T* gk = dkv + b * a.kv_batch + j * a.kv_row + h * hs;
  for (int kk = 0; kk < kMaxPerThread; ++kk) {
    const int64_t dd = threadIdx.x + kk * int64_t{blockDim.x};
    if (dd >= hs) break;
    gk[dd] += acc_k[kk];
    gk[a.v_col + dd] += acc_v[kk];
  }
}

struct ChunkExtents {
  int64_t q, kv, o, lse;
};
ChunkExtents chunk_extents(const AttentionChunk& a) {
  return {(a.B - 1) * a.q_batch + (a.Tq - 1) * a.q_row + a.C,
          (a.B - 1) * a.kv_batch + (a.Tk - 1) * a.kv_row + a.v_col + a.C,
          (a.B - 1) * a.o_batch + (a.Tq - 1) * a.o_row + a.C,
          (a.B - 1) * a.lse_batch + (a.NH - 1) * a.lse_head + a.Tq};
}

}  // namespace

template <typename T>
void CudaBackend<T>::attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn,
                                       int64_t C, int64_t NH, const DropoutSpec& dropout) const {
  const int64_t hs = C / NH, BH = B * NH, n = B * Tn * C;
  if (n == 0) return;
  Args args;
  const cuda::DeviceDropout d = cuda::device_dropout(dropout, args, Tn);
  Scratch q(sizeof(T) * n), k(sizeof(T) * n), v(sizeof(T) * n);
  Scratch s(sizeof(T) * static_cast<size_t>(BH * Tn * Tn));
  launch(k_split_heads<T>, n, q.as<T>(), k.as<T>(), v.as<T>(), args.in(qkv, 3 * n), B, Tn, NH, hs);
  const T scale = T(1) / std::sqrt(T(hs));
  const int batch = static_cast<int>(BH);
  cuda::lt_gemm<T>(false, true, Tn, Tn, hs, scale, q.as<T>(), hs, k.as<T>(), hs, T(0), s.as<T>(),
                   Tn, DType::kF32, g_.tf32, batch, Tn * hs, Tn * hs, Tn * Tn);
  k_causal_softmax<T><<<static_cast<unsigned>(BH * Tn), kThreads, 0, context().stream>>>(
      s.as<T>(), args.inout(lse, BH * Tn), NH, Tn, d);
  LOOM_CUDA_LAUNCHED();
  // o (bh, t, d) = P V, into q's scratch.
  cuda::lt_gemm<T>(false, false, Tn, hs, Tn, T(1), s.as<T>(), Tn, v.as<T>(), hs, T(0), q.as<T>(),
                   hs, DType::kF32, g_.tf32, batch, Tn * Tn, Tn * hs, Tn * hs);
  launch(k_from_heads<T>, n, args.inout(out, n), static_cast<const T*>(q.as<T>()), B, Tn, NH, hs);
  args.finish();
}

template <typename T>
void CudaBackend<T>::attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out,
                                        const T* lse, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                                        const DropoutSpec& dropout) const {
  (void)out;  // D is recomputed from the probabilities, as the reference does
  const int64_t hs = C / NH, BH = B * NH, n = B * Tn * C;
  if (n == 0) return;
  Args args;
  const cuda::DeviceDropout d = cuda::device_dropout(dropout, args, Tn);
  Scratch q(sizeof(T) * n), k(sizeof(T) * n), v(sizeof(T) * n), g(sizeof(T) * n);
  Scratch dq(sizeof(T) * n), dk(sizeof(T) * n), dv(sizeof(T) * n);
  const size_t tt = sizeof(T) * static_cast<size_t>(BH * Tn * Tn);
  Scratch p(tt), x(tt);
  launch(k_split_heads<T>, n, q.as<T>(), k.as<T>(), v.as<T>(), args.in(qkv, 3 * n), B, Tn, NH, hs);
  launch(k_to_heads<T>, n, g.as<T>(), args.in(dout, n), B, Tn, NH, hs);
  const T scale = T(1) / std::sqrt(T(hs));
  const int batch = static_cast<int>(BH);
  const bool tf32 = g_.tf32;
  const int64_t sq = Tn * hs, ss = Tn * Tn;
  cuda::lt_gemm<T>(false, true, Tn, Tn, hs, scale, q.as<T>(), hs, k.as<T>(), hs, T(0), p.as<T>(),
                   Tn, DType::kF32, tf32, batch, sq, sq, ss);
  launch(k_probs_rows<T>, BH * Tn * Tn, p.as<T>(), x.as<T>(), args.in(lse, BH * Tn), NH, Tn,
         BH * Tn, d);
  // dV = (P keep)^T dO; then dP = dO V^T into x; then dS in place.
  cuda::lt_gemm<T>(true, false, Tn, hs, Tn, T(1), x.as<T>(), Tn, g.as<T>(), hs, T(0), dv.as<T>(),
                   hs, DType::kF32, tf32, batch, ss, sq, sq);
  cuda::lt_gemm<T>(false, true, Tn, Tn, hs, T(1), g.as<T>(), hs, v.as<T>(), hs, T(0), x.as<T>(), Tn,
                   DType::kF32, tf32, batch, sq, sq, ss);
  k_score_grad<T><<<static_cast<unsigned>(BH * Tn), kThreads, 0, context().stream>>>(
      x.as<T>(), p.as<T>(), NH, Tn, scale, d);
  LOOM_CUDA_LAUNCHED();
  cuda::lt_gemm<T>(false, false, Tn, hs, Tn, T(1), x.as<T>(), Tn, k.as<T>(), hs, T(0), dq.as<T>(),
                   hs, DType::kF32, tf32, batch, ss, sq, sq);
  cuda::lt_gemm<T>(true, false, Tn, hs, Tn, T(1), x.as<T>(), Tn, q.as<T>(), hs, T(0), dk.as<T>(),
                   hs, DType::kF32, tf32, batch, ss, sq, sq);
  launch(k_merge_heads<T>, n, args.inout(dqkv, 3 * n), static_cast<const T*>(dq.as<T>()),
         static_cast<const T*>(dk.as<T>()), static_cast<const T*>(dv.as<T>()), B, Tn, NH, hs);
  args.finish();
}

template <typename T>
void CudaBackend<T>::attention_chunk_forward(T* out, T* lse, const T* q, const T* kv,
                                             const AttentionChunk& a,
                                             const DropoutSpec& dropout) const {
  if (!a.visible()) return;
  LOOM_CHECK(a.C / a.NH <= kRowThreads * kMaxPerThread,
             "head size {} above the CUDA chunk "
             "kernels' {}",
             a.C / a.NH, kRowThreads * kMaxPerThread);
  const ChunkExtents e = chunk_extents(a);
  Args args;
  // Positions of chunk pairs are global (q_pos, k_pos): no positions array.
  DropoutSpec spec = dropout;
  spec.positions = nullptr;
  const cuda::DeviceDropout d = cuda::device_dropout(spec, args, 0);
  k_chunk_forward<T>
      <<<static_cast<unsigned>(a.B * a.NH * a.Tq), kRowThreads, 0, context().stream>>>(
          args.inout(out, e.o), args.inout(lse, e.lse), args.in(q, e.q), args.in(kv, e.kv), a, d);
  LOOM_CUDA_LAUNCHED();
  args.finish();
}

template <typename T>
void CudaBackend<T>::attention_chunk_backward(T* dq, T* dkv, const T* dout, const T* q, const T* kv,
                                              const T* out, const T* lse, const AttentionChunk& a,
                                              const DropoutSpec& dropout) const {
  if (!a.visible()) return;
  LOOM_CHECK(a.C / a.NH <= kRowThreads * kMaxPerThread,
             "head size {} above the CUDA chunk "
             "kernels' {}",
             a.C / a.NH, kRowThreads * kMaxPerThread);
  const ChunkExtents e = chunk_extents(a);
  Args args;
  DropoutSpec spec = dropout;
  spec.positions = nullptr;
  const cuda::DeviceDropout d = cuda::device_dropout(spec, args, 0);
  const T* g = args.in(dout, e.o);
  const T* qd = args.in(q, e.q);
  const T* kvd = args.in(kv, e.kv);
  const T* l = args.in(lse, e.lse);
  Scratch D(sizeof(T) * static_cast<size_t>(a.B * a.NH * a.Tq));
  k_chunk_dq<T><<<static_cast<unsigned>(a.B * a.NH * a.Tq), kRowThreads, 0, context().stream>>>(
      args.inout(dq, e.q), D.as<T>(), g, qd, kvd, args.in(out, e.o), l, a, d);
  LOOM_CUDA_LAUNCHED();
  k_chunk_dkv<T><<<static_cast<unsigned>(a.B * a.NH * a.Tk), kRowThreads, 0, context().stream>>>(
      args.inout(dkv, e.kv), D.as<T>(), g, qd, kvd, l, a, d);
  LOOM_CUDA_LAUNCHED();
  args.finish();
}

// The attention members of both backends (the rest are instantiated in
// cuda_backend.cu).
#define LOOM_INSTANTIATE(T)                                                                    \
  template void CudaBackend<T>::attention_forward(T*, T*, const T*, int64_t, int64_t, int64_t, \
                                                  int64_t, const DropoutSpec&) const;          \
  template void CudaBackend<T>::attention_backward(T*, const T*, const T*, const T*, const T*, \
                                                   int64_t, int64_t, int64_t, int64_t,         \
                                                   const DropoutSpec&) const;                  \
  template void CudaBackend<T>::attention_chunk_forward(                                       \
      T*, T*, const T*, const T*, const AttentionChunk&, const DropoutSpec&) const;            \
  template void CudaBackend<T>::attention_chunk_backward(                                      \
      T*, T*, const T*, const T*, const T*, const T*, const T*, const AttentionChunk&,         \
      const DropoutSpec&) const;
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom
