#include "loom/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "loom/kernels/cpu/vec_math.h"

namespace loom::cpu {

namespace {

constexpr int64_t kBlock = 64;  // query and key block size

// One (batch, head) pair's q, k, v copied out of the strided qkv rows into
// contiguous tiles: q scaled by 1/sqrt(hs), k and v as (T, hs) and also
// transposed (hs, T), so every inner loop runs over a contiguous dimension.
template <typename T>
struct HeadTiles {
  std::vector<T> q, k, kt, v, vt;
  void load(const T* qkv, int64_t b, int64_t h, int64_t Tn, int64_t C, int64_t hs, T scale) {
    size_t n = static_cast<size_t>(Tn * hs);
    q.resize(n), k.resize(n), kt.resize(n), v.resize(n), vt.resize(n);
    for (int64_t t = 0; t < Tn; ++t) {
      const T* row = qkv + (b * Tn + t) * 3 * C + h * hs;
      for (int64_t d = 0; d < hs; ++d) {
        q[t * hs + d] = row[d] * scale;
        k[t * hs + d] = row[C + d];
        v[t * hs + d] = row[2 * C + d];
        kt[d * Tn + t] = row[C + d];
        vt[d * Tn + t] = row[2 * C + d];
      }
    }
  }
};

// s (nq, nk) = a[i0..i0+nq) (rows of length hs) @ bt[:, j0..j0+nk) where bt is (hs, Tn).
template <typename T>
void block_scores(T* s, const T* a, const T* bt, int64_t i0, int64_t nq, int64_t j0, int64_t nk,
                  int64_t hs, int64_t Tn) {
  for (int64_t i = 0; i < nq; ++i) {
    T* si = s + i * kBlock;
    std::fill(si, si + nk, T(0));
    const T* ai = a + (i0 + i) * hs;
    for (int64_t d = 0; d < hs; ++d) {
      T ad = ai[d];
      const T* bd = bt + d * Tn + j0;
      for (int64_t j = 0; j < nk; ++j) si[j] += ad * bd[j];
    }
  }
}

// Keep mask (nq, kBlock) for queries [i0, i0+nq) and keys [j0, j0+nk), or all ones.
template <typename T>
void block_keep(T* keep, const AttentionDropout& dropout, int64_t b, int64_t h, int64_t i0,
                int64_t nq, int64_t j0, int64_t nk) {
  for (int64_t i = 0; i < nq; ++i) {
    T* ki = keep + i * kBlock;
    if (!dropout.active()) {
      std::fill(ki, ki + nk, T(1));
      continue;
    }
    dropout.stream->row(dropout.sample0 + b, dropout.site | static_cast<uint32_t>(h),
                        static_cast<uint32_t>(i0 + i), j0, j0 + nk, ki);
  }
}

}  // namespace

template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                       const AttentionDropout& dropout) {
  const int64_t hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    HeadTiles<T> tiles;
    std::vector<T> s(kBlock * kBlock), keep(kBlock * kBlock), acc(kBlock * hs);
    std::vector<T> m(kBlock), l(kBlock);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < NH; ++h) {
        tiles.load(qkv, b, h, Tn, C, hs, scale);
        for (int64_t i0 = 0; i0 < Tn; i0 += kBlock) {
          int64_t nq = std::min(kBlock, Tn - i0);
          std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
          std::fill(l.begin(), l.end(), T(0));
          std::fill(acc.begin(), acc.end(), T(0));
          for (int64_t j0 = 0; j0 <= i0 + nq - 1; j0 += kBlock) {
            int64_t nk = std::min(kBlock, std::min(Tn, i0 + nq) - j0);
            block_scores(s.data(), tiles.q.data(), tiles.kt.data(), i0, nq, j0, nk, hs, Tn);
            block_keep(keep.data(), dropout, b, h, i0, nq, j0, nk);
            for (int64_t i = 0; i < nq; ++i) {
              T* si = s.data() + i * kBlock;
              int64_t jmax = std::min(nk, i0 + i - j0 + 1);  // causal: keys <= query
              if (jmax <= 0) continue;
              T bmax = m[i];
              for (int64_t j = 0; j < jmax; ++j) bmax = std::max(bmax, si[j]);
              T corr = vexp(m[i] - bmax);
              T sum = 0;
              for (int64_t j = 0; j < jmax; ++j) {
                si[j] = vexp(si[j] - bmax);
                sum += si[j];
              }
              l[i] = l[i] * corr + sum;
              m[i] = bmax;
              // acc_i = acc_i * corr + sum_j (p_ij * keep_ij) v_j
              T* ai = acc.data() + i * hs;
              const T* ki = keep.data() + i * kBlock;
              for (int64_t d = 0; d < hs; ++d) ai[d] *= corr;
              for (int64_t j = 0; j < jmax; ++j) {
                T p = si[j] * ki[j];
                const T* vj = tiles.v.data() + (j0 + j) * hs;
                for (int64_t d = 0; d < hs; ++d) ai[d] += p * vj[d];
              }
            }
          }
          for (int64_t i = 0; i < nq; ++i) {
            T* o = out + (b * Tn + i0 + i) * C + h * hs;
            T inv = T(1) / l[i];
            for (int64_t d = 0; d < hs; ++d) o[d] = acc[i * hs + d] * inv;
            lse[(b * NH + h) * Tn + i0 + i] = m[i] + std::log(l[i]);
          }
        }
      }
    }
  }
}

template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int64_t B,
                        int64_t Tn, int64_t C, int64_t NH, const AttentionDropout& dropout) {
  const int64_t hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
#pragma omp parallel
  {
    HeadTiles<T> tiles;
    std::vector<T> s(kBlock * kBlock), dp(kBlock * kBlock), keep(kBlock * kBlock);
    std::vector<T> dq, dk, dv, dO, D;
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < NH; ++h) {
        tiles.load(qkv, b, h, Tn, C, hs, scale);
        size_t n = static_cast<size_t>(Tn * hs);
        dq.assign(n, T(0)), dk.assign(n, T(0)), dv.assign(n, T(0));
        dO.resize(n), D.resize(static_cast<size_t>(Tn));
        // D_i = dO_i . O_i, the softmax-backward row term.
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
        const T* row_lse = lse + (b * NH + h) * Tn;
        for (int64_t i0 = 0; i0 < Tn; i0 += kBlock) {
          int64_t nq = std::min(kBlock, Tn - i0);
          for (int64_t j0 = 0; j0 <= i0 + nq - 1; j0 += kBlock) {
            int64_t nk = std::min(kBlock, std::min(Tn, i0 + nq) - j0);
            block_scores(s.data(), tiles.q.data(), tiles.kt.data(), i0, nq, j0, nk, hs, Tn);
            block_scores(dp.data(), dO.data(), tiles.vt.data(), i0, nq, j0, nk, hs, Tn);
            block_keep(keep.data(), dropout, b, h, i0, nq, j0, nk);
            for (int64_t i = 0; i < nq; ++i) {
              int64_t jmax = std::min(nk, i0 + i - j0 + 1);
              if (jmax <= 0) continue;
              T* si = s.data() + i * kBlock;
              T* dpi = dp.data() + i * kBlock;
              const T* ki = keep.data() + i * kBlock;
              T li = row_lse[i0 + i], Di = D[i0 + i];
              const T* dOi = dO.data() + (i0 + i) * hs;
              const T* qi = tiles.q.data() + (i0 + i) * hs;
              T* dqi = dq.data() + (i0 + i) * hs;
              for (int64_t j = 0; j < jmax; ++j) {
                T p = vexp(si[j] - li);
                T pk = p * ki[j];
                // dS_ij = p_ij (keep_ij dO_i.v_j - D_i)
                T ds = p * (dpi[j] * ki[j] - Di);
                T* dvj = dv.data() + (j0 + j) * hs;
                T* dkj = dk.data() + (j0 + j) * hs;
                const T* kj = tiles.k.data() + (j0 + j) * hs;
                for (int64_t d = 0; d < hs; ++d) {
                  dvj[d] += pk * dOi[d];
                  dkj[d] += ds * qi[d];
                  dqi[d] += ds * kj[d];
                }
              }
            }
          }
        }
        for (int64_t t = 0; t < Tn; ++t) {
          T* g = dqkv + (b * Tn + t) * 3 * C + h * hs;
          for (int64_t d = 0; d < hs; ++d) {
            g[d] += dq[t * hs + d] * scale;
            g[C + d] += dk[t * hs + d];
            g[2 * C + d] += dv[t * hs + d];
          }
        }
      }
    }
  }
}

#define LOOM_INSTANTIATE(T)                                                                \
  template void attention_forward<T>(T*, T*, const T*, int64_t, int64_t, int64_t, int64_t, \
                                     const AttentionDropout&);                             \
  template void attention_backward<T>(T*, const T*, const T*, const T*, const T*, int64_t, \
                                      int64_t, int64_t, int64_t, const AttentionDropout&);
LOOM_INSTANTIATE(float)
LOOM_INSTANTIATE(double)
#undef LOOM_INSTANTIATE

}  // namespace loom::cpu
