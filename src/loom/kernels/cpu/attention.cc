#include "loom/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "loom/core/error.h"
#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/cpu/matmul.h"
#include "loom/kernels/cpu/precision.h"
#include "loom/kernels/cpu/vec_math.h"

namespace loom::cpu {

namespace {

// Queries go in blocks of kQBlock rows, each against the keys it sees in
// blocks of up to kKBlock (only the keys up to its last row: the causal
// mask wastes at most the diagonal). Wide key blocks make few, large block
// products (a 2k-token context takes four), which is what the GEMMs'
// per-call costs ask for; the online softmax merges the blocks.
constexpr int64_t kQBlock = 64;
constexpr int64_t kKBlock = 512;

// Whether the block products take bf16 operands rounded once per (batch,
// head) rather than per product: f32 tiles with bf16 GEMM inputs on the
// bf16 matmul (the same rounded operands either way).
template <typename T>
bool rounds_tiles(const GemmConfig& g) {
  return std::is_same_v<T, float> && g.inputs == DType::kBF16 &&
         gemm_16_uses_bf16_matmul(DType::kBF16);
}

// n values rounded to bf16 into out (resized), inside the parallel region.
template <typename T>
void round_tile(const T* x, int64_t n, std::vector<uint16_t>& out) {
  out.resize(static_cast<size_t>(n));
  if constexpr (std::is_same_v<T, float>) round_to_16_serial(x, out.data(), n, DType::kBF16);
}

// A block product, C = op(A) op(B) + beta C, of T operands or, where a16 /
// b16 are given, of their bf16 roundings (rounds_tiles).
template <typename T>
void block_gemm(const GemmConfig& g, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A,
                const uint16_t* a16, int64_t lda, const T* B, const uint16_t* b16, int64_t ldb,
                T beta, T* C, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    if (a16 != nullptr || b16 != nullptr) {
      gemm_16(g.backend, DType::kBF16, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc, b16,
              a16);
      return;
    }
  }
  gemm<T>(g, ta, tb, M, N, K, T(1), A, lda, B, ldb, beta, C, ldc);
}

// One (batch, head) pair of a chunk pair: q (scaled) (Tq, hs), k and v (Tk, hs),
// and with rounds_tiles their bf16 roundings.
template <typename T>
struct ChunkTiles {
  std::vector<T> q, k, v;
  std::vector<uint16_t> q16, k16, v16;
  bool rounded = false;
  const uint16_t* q_16(int64_t at) const { return rounded ? q16.data() + at : nullptr; }
  const uint16_t* k_16(int64_t at) const { return rounded ? k16.data() + at : nullptr; }
  const uint16_t* v_16(int64_t at) const { return rounded ? v16.data() + at : nullptr; }
  void load(const GemmConfig& g, const T* qp, const T* kvp, const AttentionChunk& a, int64_t b,
            int64_t h, int64_t hs, T scale) {
    load(qp, kvp, a, b, h, hs, scale);
    rounded = rounds_tiles<T>(g);
    if (!rounded) return;
    round_tile(q.data(), a.Tq * hs, q16);
    round_tile(k.data(), a.Tk * hs, k16), round_tile(v.data(), a.Tk * hs, v16);
  }
  void load(const T* qp, const T* kvp, const AttentionChunk& a, int64_t b, int64_t h, int64_t hs,
            T scale) {
    q.resize(static_cast<size_t>(a.Tq * hs));
    k.resize(static_cast<size_t>(a.Tk * hs)), v.resize(static_cast<size_t>(a.Tk * hs));
    for (int64_t i = 0; i < a.Tq; ++i) {
      const T* row = qp + b * a.q_batch + i * a.q_row + h * hs;
      for (int64_t d = 0; d < hs; ++d) q[i * hs + d] = row[d] * scale;
    }
    for (int64_t j = 0; j < a.Tk; ++j) {
      const T* row = kvp + b * a.kv_batch + j * a.kv_row + h * hs;
      for (int64_t d = 0; d < hs; ++d) k[j * hs + d] = row[d], v[j * hs + d] = row[a.v_col + d];
    }
  }
  // The whole sequence's tiles of (b, h) from q|k|v's bf16 values (qkv16,
  // laid out as qkv (B, Tn, 3C)); bit for bit what load gives from those
  // values widened. With rounds_tiles, rounded: q widened, scaled and
  // rounded again, k and v as they are (the f32 k and v tiles are sized,
  // not filled: with bf16 tiles the products do not read them); else in
  // f32, each (batch, head) widened while in cache rather than the whole
  // of q|k|v first.
  void load16(const GemmConfig& g, const uint16_t* qkv16, int64_t Tn, int64_t C, int64_t b,
              int64_t h, int64_t hs, T scale) {
    const size_t n = static_cast<size_t>(Tn * hs);
    q.resize(n), k.resize(n), v.resize(n);
    rounded = rounds_tiles<T>(g);
    if (rounded) k16.resize(n), v16.resize(n);
    for (int64_t t = 0; t < Tn; ++t) {
      const uint16_t* row = qkv16 + (b * Tn + t) * 3 * C + h * hs;
      for (int64_t d = 0; d < hs; ++d) q[t * hs + d] = T(bf16_to_f32(row[d])) * scale;
      if (rounded) {
        std::copy_n(row + C, hs, k16.data() + t * hs);
        std::copy_n(row + 2 * C, hs, v16.data() + t * hs);
      } else {
        for (int64_t d = 0; d < hs; ++d)
          k[t * hs + d] = T(bf16_to_f32(row[C + d])),
                     v[t * hs + d] = T(bf16_to_f32(row[2 * C + d]));
      }
    }
    if (rounded) round_tile(q.data(), Tn * hs, q16);
  }
};

// q|k|v's rows of (b, h) rounded to bf16 into qkv16 (laid out as qkv (B,
// Tn, 3C)), bit for bit round_to_16 of them: q from qkv (the tile holds it
// scaled), k and v the tiles' own roundings where they have them.
template <typename T>
void store_rows16(const ChunkTiles<T>& tiles, const T* qkv, uint16_t* qkv16, int64_t b, int64_t h,
                  int64_t Tn, int64_t C, int64_t hs) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t at = (b * Tn + t) * 3 * C + h * hs;
      round_to_16_serial(qkv + at, qkv16 + at, hs, DType::kBF16);
      if (tiles.rounded) {
        std::copy_n(tiles.k16.data() + t * hs, hs, qkv16 + at + C);
        std::copy_n(tiles.v16.data() + t * hs, hs, qkv16 + at + 2 * C);
      } else {
        round_to_16_serial(qkv + at + C, qkv16 + at + C, hs, DType::kBF16);
        round_to_16_serial(qkv + at + 2 * C, qkv16 + at + 2 * C, hs, DType::kBF16);
      }
    }
  } else {
    (void)tiles, (void)qkv, (void)qkv16, (void)b, (void)h, (void)Tn, (void)C, (void)hs;
  }
}

// The whole sequence as one chunk pair of itself: q, k, v in qkv (B, Tn, 3C).
inline AttentionChunk whole_sequence(int64_t B, int64_t Tn, int64_t C, int64_t NH) {
  AttentionChunk a;
  a.B = B, a.NH = NH, a.C = C, a.Tq = Tn, a.Tk = Tn;
  a.q_row = 3 * C, a.q_batch = Tn * 3 * C, a.kv_row = 3 * C, a.kv_batch = Tn * 3 * C, a.v_col = C;
  return a;
}

// Keep mask (nq, nk; rows kKBlock apart) for queries [i0, i0+nq) and keys
// [j0, j0+nk) in keep; null without dropout (every key kept).
template <typename T>
const T* block_keep(T* keep, const DropoutSpec& dropout, int64_t b, int64_t h, int64_t i0,
                    int64_t nq, int64_t j0, int64_t nk) {
  if (!dropout.active()) return nullptr;
  for (int64_t i = 0; i < nq; ++i)
    dropout.stream->row(dropout.sample0 + b, dropout.site + static_cast<uint32_t>(h),
                        static_cast<uint32_t>(i0 + i), j0, j0 + nk, keep + i * kKBlock);
  return keep;
}

// Keys of block j0 visible to query i0 + i under the causal mask.
inline int64_t visible(int64_t i0, int64_t i, int64_t j0, int64_t nk) {
  return std::max<int64_t>(0, std::min(nk, i0 + i - j0 + 1));
}

// The largest of x[0, n) and `init`, in kLanes interleaved lanes: the
// compiler leaves a max reduction scalar, lanes it vectorises. NaN scores
// are passed over as before; only the sign of a zero maximum can differ
// from a serial loop's (+0 against -0), which neither exp(s - max) nor
// max + log(sum) can tell apart.
template <typename T>
T row_max(const T* x, int64_t n, T init) {
  constexpr int64_t kLanes = 16;
  T lane[kLanes];
  std::fill(lane, lane + kLanes, init);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) lane[k] = std::max(lane[k], x[j + k]);
  for (; j < n; ++j) lane[0] = std::max(lane[0], x[j]);
  T mx = lane[0];
  for (int64_t k = 1; k < kLanes; ++k) mx = std::max(mx, lane[k]);
  return mx;
}

// One key block of the online softmax for nq query rows: s (nq, nk; rows
// kKBlock apart) holds the scores; rescales what acc (nq, hs) accumulated
// under the old running maxima m, adds this block's exp(s - max) to l (zero
// past seen(i) keys), and leaves s = p * keep (keep null: all kept) for the
// product with v. The row loops are SIMD reductions (a fixed order).
template <typename T, typename Seen>
void online_softmax_block(T* s, const T* keep, int64_t nq, int64_t nk, int64_t hs, Seen seen, T* m,
                          T* l, T* acc) {
  for (int64_t i = 0; i < nq; ++i) {
    T* si = s + i * kKBlock;
    const int64_t jmax = seen(i);
    const T bmax = row_max(si, jmax, m[i]);
    const T corr = jmax > 0 ? vexp(m[i] - bmax) : T(1);
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < jmax; ++j) {
      const T p = vexp(si[j] - bmax);
      sum += p;
      si[j] = p;
    }
    if (keep != nullptr) {
      const T* ki = keep + i * kKBlock;
#pragma omp simd
      for (int64_t j = 0; j < jmax; ++j) si[j] *= ki[j];
    }
    std::fill(si + jmax, si + nk, T(0));
    if (jmax > 0) m[i] = bmax;
    l[i] = l[i] * corr + sum;
    T* ai = acc + i * hs;
    for (int64_t d = 0; d < hs; ++d) ai[d] *= corr;
  }
}

// The backward's block: s (scores) := p * keep, for dV; dp (dO v^T) := dS =
// p (keep dp - D_i), for dQ and dK; p = exp(s - lse_i), zero past seen(i)
// (keep null: all kept).
template <typename T, typename Seen>
void softmax_backward_block(T* s, T* dp, const T* keep, int64_t nq, int64_t nk, Seen seen,
                            const T* lse, const T* D) {
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t jmax = seen(i);
    T* si = s + i * kKBlock;
    T* dpi = dp + i * kKBlock;
    const T li = lse[i], Di = D[i];
    if (keep != nullptr) {
      const T* ki = keep + i * kKBlock;
#pragma omp simd
      for (int64_t j = 0; j < jmax; ++j) {
        const T p = vexp(si[j] - li);
        si[j] = p * ki[j];
        dpi[j] = p * (dpi[j] * ki[j] - Di);
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < jmax; ++j) {
        const T p = vexp(si[j] - li);
        si[j] = p;
        dpi[j] = p * (dpi[j] - Di);
      }
    }
    std::fill(si + jmax, si + nk, T(0));
    std::fill(dpi + jmax, dpi + nk, T(0));
  }
}

}  // namespace

// Inside the OpenMP region each thread owns whole (batch, head) pairs; the
// block GEMMs run single-threaded there (OpenBLAS does not nest threads).
template <typename T>
void attention_forward(const GemmConfig& g, T* out, T* lse, const T* qkv, int64_t B, int64_t Tn,
                       int64_t C, int64_t NH, const DropoutSpec& dropout, uint16_t* qkv16) {
  LOOM_CHECK(qkv16 == nullptr || (std::is_same_v<T, float>),
             "attention_forward: q|k|v in bf16 beside f32 values only");
  const int64_t hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    ChunkTiles<T> tiles;
    const AttentionChunk whole = whole_sequence(B, Tn, C, NH);
    std::vector<T> s(kQBlock * kKBlock), keep(kQBlock * kKBlock), acc(kQBlock * hs);
    std::vector<T> m(kQBlock), l(kQBlock);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < NH; ++h) {
        tiles.load(g, qkv, qkv + C, whole, b, h, hs, scale);
        if (qkv16 != nullptr) store_rows16(tiles, qkv, qkv16, b, h, Tn, C, hs);
        for (int64_t i0 = 0; i0 < Tn; i0 += kQBlock) {
          const int64_t nq = std::min(kQBlock, Tn - i0);
          std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
          std::fill(l.begin(), l.end(), T(0));
          std::fill(acc.begin(), acc.end(), T(0));
          for (int64_t j0 = 0; j0 < i0 + nq; j0 += kKBlock) {
            const int64_t nk = std::min(kKBlock, i0 + nq - j0);  // keys the last row sees
            // s (nq, nk) = q_i k_j^T
            block_gemm(g, false, true, nq, nk, hs, tiles.q.data() + i0 * hs, tiles.q_16(i0 * hs),
                       hs, tiles.k.data() + j0 * hs, tiles.k_16(j0 * hs), hs, T(0), s.data(),
                       kKBlock);
            const T* kept = block_keep(keep.data(), dropout, b, h, i0, nq, j0, nk);
            online_softmax_block(
                s.data(), kept, nq, nk, hs, [&](int64_t i) { return visible(i0, i, j0, nk); },
                m.data(), l.data(), acc.data());
            // acc (nq, hs) += (p * keep) v_j
            block_gemm(g, false, false, nq, hs, nk, s.data(), nullptr, kKBlock,
                       tiles.v.data() + j0 * hs, tiles.v_16(j0 * hs), hs, T(1), acc.data(), hs);
          }
          for (int64_t i = 0; i < nq; ++i) {
            T* o = out + (b * Tn + i0 + i) * C + h * hs;
            const T inv = T(1) / l[i];
            for (int64_t d = 0; d < hs; ++d) o[d] = acc[i * hs + d] * inv;
            lse[(b * NH + h) * Tn + i0 + i] = m[i] + std::log(l[i]);
          }
        }
      }
    }
  }
}

template <typename T>
void attention_backward(const GemmConfig& g, T* dqkv, const T* dout, const T* qkv, const T* out,
                        const T* lse, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                        const DropoutSpec& dropout, const uint16_t* qkv16) {
  LOOM_CHECK(qkv16 == nullptr || (std::is_same_v<T, float>),
             "attention_backward: q|k|v in bf16 for f32 values only");
  const int64_t hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    ChunkTiles<T> tiles;
    const AttentionChunk whole = whole_sequence(B, Tn, C, NH);
    std::vector<T> s(kQBlock * kKBlock), dp(kQBlock * kKBlock), keep(kQBlock * kKBlock);
    std::vector<T> dq, dk, dv, dO, D;
    // With rounds_tiles: dO rounded once per (batch, head), and each block's
    // dS once for its two products.
    std::vector<uint16_t> dO16, ds16(kQBlock * kKBlock);
    auto dO_16 = [&](int64_t at) { return tiles.rounded ? dO16.data() + at : nullptr; };
    auto round_ds = [&](int64_t nq, int64_t nk) -> const uint16_t* {
      if (!tiles.rounded) return nullptr;
      if constexpr (std::is_same_v<T, float>)
        for (int64_t i = 0; i < nq; ++i)
          round_to_16_serial(dp.data() + i * kKBlock, ds16.data() + i * kKBlock, nk, DType::kBF16);
      return ds16.data();
    };
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < NH; ++h) {
        if (qkv16 != nullptr)
          tiles.load16(g, qkv16, Tn, C, b, h, hs, scale);
        else
          tiles.load(g, qkv, qkv + C, whole, b, h, hs, scale);
        const size_t n = static_cast<size_t>(Tn * hs);
        dq.assign(n, T(0)), dk.assign(n, T(0)), dv.assign(n, T(0));
        dO.resize(n), D.resize(static_cast<size_t>(Tn));
        // D_i = dO_i . O_i, the row term of the softmax backward.
        for (int64_t t = 0; t < Tn; ++t) {
          const T* g = dout + (b * Tn + t) * C + h * hs;
          const T* o = out + (b * Tn + t) * C + h * hs;
          T acc = 0;
          for (int64_t d = 0; d < hs; ++d) {
            dO[t * hs + d] = g[d];
            acc += g[d] * o[d];
          }
          D[t] = acc;
        }
        if (tiles.rounded) round_tile(dO.data(), Tn * hs, dO16);
        const T* row_lse = lse + (b * NH + h) * Tn;
        for (int64_t i0 = 0; i0 < Tn; i0 += kQBlock) {
          const int64_t nq = std::min(kQBlock, Tn - i0);
          for (int64_t j0 = 0; j0 < i0 + nq; j0 += kKBlock) {
            const int64_t nk = std::min(kKBlock, i0 + nq - j0);  // keys the last row sees
            block_gemm(g, false, true, nq, nk, hs, tiles.q.data() + i0 * hs, tiles.q_16(i0 * hs),
                       hs, tiles.k.data() + j0 * hs, tiles.k_16(j0 * hs), hs, T(0), s.data(),
                       kKBlock);
            block_gemm(g, false, true, nq, nk, hs, dO.data() + i0 * hs, dO_16(i0 * hs), hs,
                       tiles.v.data() + j0 * hs, tiles.v_16(j0 * hs), hs, T(0), dp.data(), kKBlock);
            const T* kept = block_keep(keep.data(), dropout, b, h, i0, nq, j0, nk);
            softmax_backward_block(
                s.data(), dp.data(), kept, nq, nk,
                [&](int64_t i) { return visible(i0, i, j0, nk); }, row_lse + i0, D.data() + i0);
            // dv_j += (p keep)^T dO_i; dq_i += dS k_j; dk_j += dS^T q_i
            const uint16_t* dS16 = round_ds(nq, nk);  // read by the two products after
            block_gemm(g, true, false, nk, hs, nq, s.data(), nullptr, kKBlock, dO.data() + i0 * hs,
                       dO_16(i0 * hs), hs, T(1), dv.data() + j0 * hs, hs);
            block_gemm(g, false, false, nq, hs, nk, dp.data(), dS16, kKBlock,
                       tiles.k.data() + j0 * hs, tiles.k_16(j0 * hs), hs, T(1), dq.data() + i0 * hs,
                       hs);
            block_gemm(g, true, false, nk, hs, nq, dp.data(), dS16, kKBlock,
                       tiles.q.data() + i0 * hs, tiles.q_16(i0 * hs), hs, T(1), dk.data() + j0 * hs,
                       hs);
          }
        }
        for (int64_t t = 0; t < Tn; ++t) {
          T* g = dqkv + (b * Tn + t) * 3 * C + h * hs;
          for (int64_t d = 0; d < hs; ++d) {
            g[d] = dq[t * hs + d] * scale;
            g[C + d] = dk[t * hs + d];
            g[2 * C + d] = dv[t * hs + d];
          }
        }
      }
    }
  }
}

namespace {

// Keep mask (nq, nk; rows kKBlock apart) for global queries [qp0, qp0 + nq)
// and global keys [kp0, kp0 + nk) in keep: the masks attention_forward draws
// at those positions (drawn from the aligned channel below kp0, as the
// stream draws in fours); null without dropout.
template <typename T>
const T* chunk_keep(T* keep, std::vector<T>& tmp, const DropoutSpec& dropout, int64_t b, int64_t h,
                    int64_t qp0, int64_t nq, int64_t kp0, int64_t nk) {
  if (!dropout.active()) return nullptr;
  const int64_t a0 = kp0 / 4 * 4;
  tmp.resize(static_cast<size_t>(kp0 + nk - a0));
  for (int64_t i = 0; i < nq; ++i) {
    dropout.stream->row(dropout.sample0 + b, dropout.site + static_cast<uint32_t>(h),
                        static_cast<uint32_t>(qp0 + i), a0, kp0 + nk, tmp.data());
    std::copy(tmp.begin() + (kp0 - a0), tmp.begin() + (kp0 - a0 + nk), keep + i * kKBlock);
  }
  return keep;
}

// Keys of the block at global kp0 visible to the query at global qp.
inline int64_t visible_at(int64_t qp, int64_t kp0, int64_t nk) {
  return std::max<int64_t>(0, std::min(nk, qp - kp0 + 1));
}

}  // namespace

template <typename T>
void attention_chunk_forward(const GemmConfig& g, T* out, T* lse, const T* q, const T* kv,
                             const AttentionChunk& a, const DropoutSpec& dropout) {
  if (!a.visible()) return;
  const int64_t hs = a.C / a.NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    ChunkTiles<T> tiles;
    std::vector<T> s(kQBlock * kKBlock), keep(kQBlock * kKBlock), acc(kQBlock * hs), tmp;
    std::vector<T> m(kQBlock), l(kQBlock);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < a.B; ++b) {
      for (int64_t h = 0; h < a.NH; ++h) {
        tiles.load(g, q, kv, a, b, h, hs, scale);
        for (int64_t i0 = 0; i0 < a.Tq; i0 += kQBlock) {
          const int64_t nq = std::min(kQBlock, a.Tq - i0), qp0 = a.q_pos + i0;
          std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
          std::fill(l.begin(), l.end(), T(0));
          std::fill(acc.begin(), acc.end(), T(0));
          for (int64_t j0 = 0; j0 < a.Tk && a.k_pos + j0 <= qp0 + nq - 1; j0 += kKBlock) {
            const int64_t kp0 = a.k_pos + j0;
            const int64_t nk =
                std::min({kKBlock, a.Tk - j0, qp0 + nq - kp0});  // seen by the last row
            block_gemm(g, false, true, nq, nk, hs, tiles.q.data() + i0 * hs, tiles.q_16(i0 * hs),
                       hs, tiles.k.data() + j0 * hs, tiles.k_16(j0 * hs), hs, T(0), s.data(),
                       kKBlock);
            const T* kept = chunk_keep(keep.data(), tmp, dropout, b, h, qp0, nq, kp0, nk);
            online_softmax_block(
                s.data(), kept, nq, nk, hs, [&](int64_t i) { return visible_at(qp0 + i, kp0, nk); },
                m.data(), l.data(), acc.data());
            block_gemm(g, false, false, nq, hs, nk, s.data(), nullptr, kKBlock,
                       tiles.v.data() + j0 * hs, tiles.v_16(j0 * hs), hs, T(1), acc.data(), hs);
          }
          // Merge: out and lse over the keys before, and these keys'
          // acc / l with log-sum-exp m + log l.
          for (int64_t i = 0; i < nq; ++i) {
            if (l[i] == T(0)) continue;  // no key of this chunk visible
            T* o = out + b * a.o_batch + (i0 + i) * a.o_row + h * hs;
            T& li = lse[b * a.lse_batch + h * a.lse_head + i0 + i];
            const T lb = m[i] + std::log(l[i]);
            const bool first = li == -std::numeric_limits<T>::infinity();
            const T ln = first ? lb : std::max(li, lb) + std::log1p(std::exp(-std::abs(li - lb)));
            const T wo = first ? T(0) : std::exp(li - ln), wb = std::exp(m[i] - ln);
            for (int64_t d = 0; d < hs; ++d) o[d] = o[d] * wo + acc[i * hs + d] * wb;
            li = ln;
          }
        }
      }
    }
  }
}

template <typename T>
void attention_chunk_backward(const GemmConfig& g, T* dq, T* dkv, const T* dout, const T* q,
                              const T* kv, const T* out, const T* lse, const AttentionChunk& a,
                              const DropoutSpec& dropout) {
  if (!a.visible()) return;
  const int64_t hs = a.C / a.NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    ChunkTiles<T> tiles;
    std::vector<T> s(kQBlock * kKBlock), dp(kQBlock * kKBlock), keep(kQBlock * kKBlock), tmp;
    std::vector<T> gq, gk, gv, dO, D;
    // With rounds_tiles: dO rounded once per (batch, head), and each block's
    // dS once for its two products.
    std::vector<uint16_t> dO16, ds16(kQBlock * kKBlock);
    auto dO_16 = [&](int64_t at) { return tiles.rounded ? dO16.data() + at : nullptr; };
    auto round_ds = [&](int64_t nq, int64_t nk) -> const uint16_t* {
      if (!tiles.rounded) return nullptr;
      if constexpr (std::is_same_v<T, float>)
        for (int64_t i = 0; i < nq; ++i)
          round_to_16_serial(dp.data() + i * kKBlock, ds16.data() + i * kKBlock, nk, DType::kBF16);
      return ds16.data();
    };
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < a.B; ++b) {
      for (int64_t h = 0; h < a.NH; ++h) {
        tiles.load(g, q, kv, a, b, h, hs, scale);
        gq.assign(static_cast<size_t>(a.Tq * hs), T(0));
        gk.assign(static_cast<size_t>(a.Tk * hs), T(0));
        gv.assign(static_cast<size_t>(a.Tk * hs), T(0));
        dO.resize(static_cast<size_t>(a.Tq * hs)), D.resize(static_cast<size_t>(a.Tq));
        // D_i = dO_i . O_i over the final output (every key's share).
        for (int64_t i = 0; i < a.Tq; ++i) {
          const T* gi = dout + b * a.o_batch + i * a.o_row + h * hs;
          const T* oi = out + b * a.o_batch + i * a.o_row + h * hs;
          T acc = 0;
          for (int64_t d = 0; d < hs; ++d) {
            dO[i * hs + d] = gi[d];
            acc += gi[d] * oi[d];
          }
          D[i] = acc;
        }
        if (tiles.rounded) round_tile(dO.data(), a.Tq * hs, dO16);
        const T* row_lse = lse + b * a.lse_batch + h * a.lse_head;
        for (int64_t i0 = 0; i0 < a.Tq; i0 += kQBlock) {
          const int64_t nq = std::min(kQBlock, a.Tq - i0), qp0 = a.q_pos + i0;
          for (int64_t j0 = 0; j0 < a.Tk && a.k_pos + j0 <= qp0 + nq - 1; j0 += kKBlock) {
            const int64_t kp0 = a.k_pos + j0;
            const int64_t nk =
                std::min({kKBlock, a.Tk - j0, qp0 + nq - kp0});  // seen by the last row
            block_gemm(g, false, true, nq, nk, hs, tiles.q.data() + i0 * hs, tiles.q_16(i0 * hs),
                       hs, tiles.k.data() + j0 * hs, tiles.k_16(j0 * hs), hs, T(0), s.data(),
                       kKBlock);
            block_gemm(g, false, true, nq, nk, hs, dO.data() + i0 * hs, dO_16(i0 * hs), hs,
                       tiles.v.data() + j0 * hs, tiles.v_16(j0 * hs), hs, T(0), dp.data(), kKBlock);
            const T* kept = chunk_keep(keep.data(), tmp, dropout, b, h, qp0, nq, kp0, nk);
            softmax_backward_block(
                s.data(), dp.data(), kept, nq, nk,
                [&](int64_t i) { return visible_at(qp0 + i, kp0, nk); }, row_lse + i0,
                D.data() + i0);
            const uint16_t* dS16 = round_ds(nq, nk);  // read by the two products after
            block_gemm(g, true, false, nk, hs, nq, s.data(), nullptr, kKBlock, dO.data() + i0 * hs,
                       dO_16(i0 * hs), hs, T(1), gv.data() + j0 * hs, hs);
            block_gemm(g, false, false, nq, hs, nk, dp.data(), dS16, kKBlock,
                       tiles.k.data() + j0 * hs, tiles.k_16(j0 * hs), hs, T(1), gq.data() + i0 * hs,
                       hs);
            block_gemm(g, true, false, nk, hs, nq, dp.data(), dS16, kKBlock,
                       tiles.q.data() + i0 * hs, tiles.q_16(i0 * hs), hs, T(1), gk.data() + j0 * hs,
                       hs);
          }
        }
        for (int64_t i = 0; i < a.Tq; ++i) {
          T* r = dq + b * a.q_batch + i * a.q_row + h * hs;
          for (int64_t d = 0; d < hs; ++d) r[d] += gq[i * hs + d] * scale;
        }
        for (int64_t j = 0; j < a.Tk; ++j) {
          T* r = dkv + b * a.kv_batch + j * a.kv_row + h * hs;
          for (int64_t d = 0; d < hs; ++d) {
            r[d] += gk[j * hs + d];
            r[a.v_col + d] += gv[j * hs + d];
          }
        }
      }
    }
  }
}

#define LOOM_INSTANTIATE(T)                                                                      \
  template void attention_forward<T>(const GemmConfig&, T*, T*, const T*, int64_t, int64_t,      \
                                     int64_t, int64_t, const DropoutSpec&, uint16_t*);           \
  template void attention_backward<T>(const GemmConfig&, T*, const T*, const T*, const T*,       \
                                      const T*, int64_t, int64_t, int64_t, int64_t,              \
                                      const DropoutSpec&, const uint16_t*);                      \
  template void attention_chunk_forward<T>(const GemmConfig&, T*, T*, const T*, const T*,        \
                                           const AttentionChunk&, const DropoutSpec&);           \
  template void attention_chunk_backward<T>(const GemmConfig&, T*, T*, const T*, const T*,       \
                                            const T*, const T*, const T*, const AttentionChunk&, \
                                            const DropoutSpec&);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
