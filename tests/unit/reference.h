// Naive double-precision references for the CPU kernels: the plainest loops
// that compute each definition, the oracle for the fast kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "loom/core/rng.h"

namespace loom::ref {

using Vec = std::vector<double>;

inline void matmul(Vec& out, const Vec& inp, const Vec& w, const Vec* bias, int64_t N, int64_t C,
                   int64_t OC) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = bias ? (*bias)[o] : 0.0;
      for (int64_t c = 0; c < C; ++c) acc += inp[n * C + c] * w[c * OC + o];
      out[n * OC + o] = acc;
    }
}

inline void layernorm(Vec& out, const Vec& x, const Vec& w, const Vec& b, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < C; ++c) mean += x[n * C + c] / C;
    for (int64_t c = 0; c < C; ++c) var += (x[n * C + c] - mean) * (x[n * C + c] - mean) / C;
    for (int64_t c = 0; c < C; ++c)
      out[n * C + c] = (x[n * C + c] - mean) / std::sqrt(var + 1e-5) * w[c] + b[c];
  }
}

inline double gelu(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

// Full-matrix causal attention with optional dropout on the probabilities.
inline void attention(Vec& out, const Vec& qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                      const DropoutStream* stream, uint64_t sample0, uint32_t site) {
  int64_t hs = C / NH;
  std::vector<double> keep(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(static_cast<size_t>(i + 1));
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hs; ++d)
            dot +=
                qkv[(b * T + i) * 3 * C + h * hs + d] * qkv[(b * T + j) * 3 * C + C + h * hs + d];
          s[j] = dot / std::sqrt(double(hs));
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (auto& v : s) sum += (v = std::exp(v - mx));
        if (stream && stream->p() > 0)
          stream->row(sample0 + b, site | uint32_t(h), uint32_t(i), 0, T, keep.data());
        else
          std::fill(keep.begin(), keep.end(), 1.0);
        for (int64_t d = 0; d < hs; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j)
            acc += s[j] / sum * keep[j] * qkv[(b * T + j) * 3 * C + 2 * C + h * hs + d];
          out[(b * T + i) * C + h * hs + d] = acc;
        }
      }
}

inline void cross_entropy(Vec& losses, const Vec& logits, const std::vector<int32_t>& targets,
                          int64_t N, int64_t V, int64_t Vp) {
  for (int64_t n = 0; n < N; ++n) {
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[n * Vp + v]);
    losses[n] = std::log(sum) - logits[n * Vp + targets[n]];
  }
}

}  // namespace loom::ref
