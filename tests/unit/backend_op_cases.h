// The operation table of the backend test (test_backend_ops.cc): what one
// entry holds, the helpers entries are written with, and the entries
// themselves (backend_op_cases.cc).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/kernels/backend.h"
#include "loom/kernels/cpu/cpu_backend.h"
#include "loom/kernels/reference/reference_backend.h"

namespace loom::backend_test {

// --- the operations ----------------------------------------------------------

template <typename T>
using Vecs = std::vector<std::vector<T>>;
template <typename T>
using Forward = std::function<void(const Backend<T>&, const Vecs<T>&, Vecs<T>&)>;
// (backend, inputs, forward's outputs, gradients of the outputs) -> gradients
// of the inputs, added into g.
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
  bool accumulates = true;  // backward adds into the input gradients
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

inline constexpr int64_t kB = 2, kT = 70, kC = 16, kNH = 2;  // T > one 64-wide block

// Every entry, in the order the table lists them.
std::vector<OpCase> make_ops();

}  // namespace loom::backend_test
