// The operation table of the backend test (test_backend_ops.cc): what one
// entry holds, the helpers entries are written with, and the entries
// themselves (backend_op_cases.cc).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/kernels/backend.h"
#include "loom/kernels/cpu/cpu_backend.h"
#include "loom/kernels/reference/reference_backend.h"

namespace loom::backend_test {

// Causal attention over a sequence cut into chunks (context parallelism's
// kernels): every (query chunk, key chunk) pair merged in a scrambled key
// order, chunks of 3 tokens so key chunks start off the 4-aligned channel
// dropout draws in. Forward must equal attention over the whole sequence;
// backward, the sum over pairs, its exact gradient.
template <typename T>
void chunked_attention(const Backend<T>& be, T* out, T* lse, const T* qkv, int64_t B, int64_t Tn,
                       int64_t C, int64_t NH, int64_t Tc, const DropoutSpec& drop) {
  be.fill(out, B * Tn * C, T(0));
  be.fill(lse, B * NH * Tn, -std::numeric_limits<T>::infinity());
  const int64_t n = Tn / Tc;
  for (int64_t qc = 0; qc < n; ++qc)
    for (int64_t r = 0; r < n; ++r) {
      const int64_t kc = (r * 3 + qc) % n;  // keys in an order other than the sequence's
      AttentionChunk a;
      a.B = B, a.NH = NH, a.C = C, a.Tq = Tc, a.Tk = Tc, a.q_pos = qc * Tc, a.k_pos = kc * Tc;
      a.q_row = 3 * C, a.q_batch = Tn * 3 * C, a.kv_row = 3 * C, a.kv_batch = Tn * 3 * C;
      a.v_col = C, a.o_row = C, a.o_batch = Tn * C, a.lse_batch = NH * Tn, a.lse_head = Tn;
      be.attention_chunk_forward(out + qc * Tc * C, lse + qc * Tc, qkv + qc * Tc * 3 * C,
                                 qkv + kc * Tc * 3 * C + C, a, drop);
    }
}

template <typename T>
void chunked_attention_backward(const Backend<T>& be, T* dqkv, const T* dout, const T* qkv,
                                const T* out, const T* lse, int64_t B, int64_t Tn, int64_t C,
                                int64_t NH, int64_t Tc, const DropoutSpec& drop) {
  const int64_t n = Tn / Tc;
  for (int64_t qc = 0; qc < n; ++qc)
    for (int64_t kc = 0; kc < n; ++kc) {
      AttentionChunk a;
      a.B = B, a.NH = NH, a.C = C, a.Tq = Tc, a.Tk = Tc, a.q_pos = qc * Tc, a.k_pos = kc * Tc;
      a.q_row = 3 * C, a.q_batch = Tn * 3 * C, a.kv_row = 3 * C, a.kv_batch = Tn * 3 * C;
      a.v_col = C, a.o_row = C, a.o_batch = Tn * C, a.lse_batch = NH * Tn, a.lse_head = Tn;
      be.attention_chunk_backward(dqkv + qc * Tc * 3 * C, dqkv + kc * Tc * 3 * C + C,
                                  dout + qc * Tc * C, qkv + qc * Tc * 3 * C,
                                  qkv + kc * Tc * 3 * C + C, out + qc * Tc * C, lse + qc * Tc, a,
                                  drop);
    }
}

// --- the operations ----------------------------------------------------------

template <typename T>
using Vecs = std::vector<std::vector<T>>;
template <typename T>
using Forward = std::function<void(const Backend<T>&, const Vecs<T>&, Vecs<T>&)>;
// (backend, inputs, forward's outputs, gradients of the outputs) -> gradients
// of the inputs, added into g (written over it where OpCase::sets says).
template <typename T>
using Backward = std::function<void(const Backend<T>&, const Vecs<T>&, const Vecs<T>&,
                                    const Vecs<T>&, Vecs<T>&)>;

struct OpCase {
  std::string name;
  std::vector<Op> covers;  // the backend operations it runs
  std::vector<int64_t> in_sizes, out_sizes;
  std::vector<bool> compared;  // per output: checked, and part of the loss
  Forward<float> fwd_f;
  Forward<double> fwd_d;  // null: an f32-only (16-bit) operation
  Backward<float> bwd_f;  // null: not differentiable, values only
  Backward<double> bwd_d;
  double fwd_tol = 2e-5;
  // Per input: backward writes its gradient over the buffer (GradWrite::kSet
  // and the operations that always do); empty: every input's is added.
  std::vector<bool> sets;
  bool sets_input(size_t k) const { return k < sets.size() && sets[k]; }
  std::function<void(Vecs<double>&)> adjust_inputs;
};

template <typename F>
inline void set_forward(OpCase& op, F f) {
  op.fwd_f = f;
  op.fwd_d = f;
}
// The 16-bit operations exist for f32 alone.
template <typename F>
inline void set_forward_f32(OpCase& op, F f) {
  op.fwd_f = f;
}
template <typename F>
inline void set_backward(OpCase& op, F f) {
  op.bwd_f = f;
  op.bwd_d = f;
}

inline OpCase make_case(std::string name, std::vector<Op> covers, std::vector<int64_t> in,
                        std::vector<int64_t> out, std::vector<bool> compared) {
  OpCase op;
  op.name = std::move(name);
  op.covers = std::move(covers);
  op.in_sizes = std::move(in);
  op.out_sizes = std::move(out);
  op.compared = std::move(compared);
  return op;
}

template <typename T>
Vecs<T> sized(const std::vector<int64_t>& sizes) {
  Vecs<T> v;
  for (int64_t n : sizes) v.emplace_back(static_cast<size_t>(n), T(0));
  return v;
}

template <typename T>
Vecs<T> convert(const Vecs<double>& v) {
  Vecs<T> f;
  for (const auto& x : v) f.emplace_back(x.begin(), x.end());
  return f;
}

inline Vecs<double> random_inputs(const OpCase& op, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  Vecs<double> in = sized<double>(op.in_sizes);
  for (auto& v : in)
    for (auto& x : v) x = dist(gen);
  if (op.adjust_inputs) op.adjust_inputs(in);
  return in;
}

inline std::vector<int32_t> make_tokens(int64_t n, int32_t vocab, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(gen() % static_cast<uint32_t>(vocab));
  return t;
}

// 16-bit values as the operations take them: x rounded to t (the rounding
// itself is tested apart), and back.
inline std::vector<uint16_t> to_16(const std::vector<float>& x, DType t) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    h[i] = t == DType::kBF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
  return h;
}
inline void from_16(const std::vector<uint16_t>& h, std::vector<float>& x, DType t) {
  for (size_t i = 0; i < h.size(); ++i)
    x[i] = t == DType::kBF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
}

inline constexpr int64_t kB = 2, kT = 70, kC = 16, kNH = 2;  // T > one 64-row query block

// Every entry, in the order the table lists them.
std::vector<OpCase> make_ops();

}  // namespace loom::backend_test
