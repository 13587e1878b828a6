// Parameter gradients put off until later: the zero-bubble pipeline splits a
// backward into B (the input gradient, on the critical path between stages)
// and W (the parameter gradients, run where the schedule has a gap).
//
// During B the store points at a DeferredGrads; each layer computes its input
// gradient at once and records what its parameter gradients need (copies of
// the output gradient and of the input, so nothing in the activation store
// or the backward scratch has to outlive B) together with the work, under the
// unit being backwarded. W runs the records unit by unit. The arithmetic is
// the same kernels on the same values, so the gradients are those of an
// undivided backward.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "loom/core/memory.h"
#include "loom/nn/param_store.h"

namespace loom {

template <typename T>
class DeferredGrads {
 public:
  using Work = std::function<void(const ParamStore<T>&)>;

  // Records now go under unit u (the stage's backward order).
  void begin_unit(int u) { unit_ = u; }
  // A copy of n elements, owned here until clear().
  template <typename E>
  const E* keep(const E* src, int64_t n);
  void add(Work w);
  // Units in the order their work was recorded, repeats in a row merged.
  std::vector<int> units() const;
  // Runs the work of segment k (see units()) against `ps`.
  void run(size_t k, const ParamStore<T>& ps) const;
  bool empty() const { return segments_.empty(); }
  void clear();

 private:
  struct Segment {
    int unit;
    std::vector<Work> work;
  };
  int unit_ = -1;
  std::vector<Segment> segments_;
  std::vector<Buffer> kept_;
};

// dinp (N, C) += dout @ W^T now (= with dinp_write kSet); W (C, OC) += inp^T
// @ dout and b (OC) += column sums of dout now, or in W when the store
// defers (b may be invalid). inp: ParamStore::input's (a bf16 twin never
// goes with a deferral).
template <typename T>
void linear_backward(const ParamStore<T>& ps, T* dinp, ParamId w, ParamId b, const T* dout,
                     InputArg<T> inp, int64_t N, int64_t C, int64_t OC,
                     GradWrite dinp_write = GradWrite::kAdd);

// The tied LM head: dinp (N, C) += dout (N, V) @ wte now; wte (V, C) +=
// dout^T @ inp now or deferred.
template <typename T>
void tied_head_backward(const ParamStore<T>& ps, T* dinp, ParamId wte, const T* dout, const T* inp,
                        int64_t N, int64_t C, int64_t V);

// LayerNorm: dx now; the weight's and bias's gradients (sums over the rows
// of dout x xhat and dout) now or deferred. `reduce`, when given, adds the
// two (2C: weight's then bias's, summed over this rank's rows) across the
// ranks that split the rows before they reach the gradients.
template <typename T>
void layernorm_backward(const ParamStore<T>& ps, T* dx, ParamId w, ParamId b, const T* dout,
                        const T* x, const T* mean, const T* rstd, int64_t N, int64_t C,
                        const std::function<void(T*, int64_t)>& reduce = {});

}  // namespace loom
