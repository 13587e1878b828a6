#include "loom/nn/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "loom/core/error.h"

namespace loom {

namespace {

// Capacity, within each group: each expert keeps its assignments with the
// largest gates (then the earlier token, then the earlier slot).
template <typename T>
void drop_over_capacity(Routing<T>& r, const RouterConfig& c) {
  const int E = r.experts, k = r.k;
  const int64_t tokens = r.tokens, group = r.group;
  if (c.capacity_factor <= 0) return;
  r.capacity =
      static_cast<int64_t>(std::ceil(c.capacity_factor * double(group) * double(k) / double(E)));
  std::vector<int64_t> slots;
  for (int64_t g0 = 0; g0 < tokens; g0 += group) {
    for (int e = 0; e < E; ++e) {
      slots.clear();
      for (int64_t s = g0 * k; s < (g0 + group) * k; ++s)
        if (r.expert[static_cast<size_t>(s)] == e) slots.push_back(s);
      if (static_cast<int64_t>(slots.size()) <= r.capacity) continue;
      std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
        // A non-finite gate (NaN activations) sorts last: a strict order
        // always, so the step reaches the non-finite check.
        auto key = [&](int64_t s) {
          const T g = r.gate[static_cast<size_t>(s)];
          return std::isfinite(g) ? g : -std::numeric_limits<T>::infinity();
        };
        const T ga = key(a), gb = key(b);
        return ga != gb ? ga > gb : a < b;  // slot index orders token, then slot
      });
      for (size_t i = static_cast<size_t>(r.capacity); i < slots.size(); ++i) {
        r.kept[static_cast<size_t>(slots[i])] = 0;
        ++r.dropped;
      }
    }
  }
}

// splitmix64's finaliser: a well-mixed 64-bit hash.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

template <typename T>
Routing<T> route(const T* logits, int64_t tokens, int64_t group, const RouterConfig& c,
                 const T* bias) {
  const int E = c.num_experts, k = c.top_k;
  LOOM_CHECK(E >= 1 && k >= 1 && k <= E, "router: top_k {} of {} experts", k, E);
  LOOM_CHECK(group >= 1 && tokens % group == 0, "router: {} tokens in groups of {}", tokens, group);
  Routing<T> r;
  r.tokens = tokens, r.group = group, r.k = k, r.experts = E;
  r.expert.assign(static_cast<size_t>(tokens * k), -1);
  r.gate.assign(static_cast<size_t>(tokens * k), T(0));
  r.kept.assign(static_cast<size_t>(tokens * k), 1);
  r.probs.assign(static_cast<size_t>(tokens * E), T(0));
  r.lse.assign(static_cast<size_t>(tokens), T(0));
  r.load.assign(static_cast<size_t>(E), 0);
  std::vector<int> order(static_cast<size_t>(E));
  double z = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const T* l = logits + t * E;
    T* p = r.probs.data() + t * E;
    const T mx = *std::max_element(l, l + E);
    T sum = 0;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
    for (int e = 0; e < E; ++e) p[e] /= sum;
    r.lse[static_cast<size_t>(t)] = mx + std::log(sum);
    z += double(r.lse[static_cast<size_t>(t)]) * double(r.lse[static_cast<size_t>(t)]);
    // The k largest, a tie to the lower expert.
    std::iota(order.begin(), order.end(), 0);
    auto score = [&](int e) { return bias ? p[e] + bias[e] : p[e]; };
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
      const T sa = score(a), sb = score(b);
      return sa != sb ? sa > sb : a < b;
    });
    T chosen = 0;
    for (int j = 0; j < k; ++j) chosen += p[order[static_cast<size_t>(j)]];
    for (int j = 0; j < k; ++j) {
      const int e = order[static_cast<size_t>(j)];
      r.expert[static_cast<size_t>(t * k + j)] = e;
      r.gate[static_cast<size_t>(t * k + j)] = k > 1 ? p[e] / chosen : p[e];
      ++r.load[static_cast<size_t>(e)];
    }
  }
  r.z = tokens > 0 ? z / double(tokens) : 0;

  drop_over_capacity(r, c);

  // The load-balancing loss per group, averaged over the groups.
  double aux = 0;
  std::vector<double> f(static_cast<size_t>(E)), P(static_cast<size_t>(E));
  for (int64_t g0 = 0; g0 < tokens; g0 += group) {
    std::fill(f.begin(), f.end(), 0.0);
    std::fill(P.begin(), P.end(), 0.0);
    for (int64_t t = g0; t < g0 + group; ++t) {
      for (int j = 0; j < k; ++j)
        f[static_cast<size_t>(r.expert[static_cast<size_t>(t * k + j)])] += 1;
      for (int e = 0; e < E; ++e)
        P[static_cast<size_t>(e)] += double(r.probs[static_cast<size_t>(t * E + e)]);
    }
    double s = 0;
    for (int e = 0; e < E; ++e)
      s +=
          f[static_cast<size_t>(e)] / double(group * k) * P[static_cast<size_t>(e)] / double(group);
    aux += double(E) * s;
  }
  r.aux = tokens > 0 ? aux / double(tokens / group) : 0;
  return r;
}

void fixed_experts(const int32_t* ids, int64_t tokens, int64_t group, const RouterConfig& c,
                   int32_t* experts, int64_t history) {
  const int E = c.num_experts, k = c.top_k;
  LOOM_CHECK(c.kind != RouterKind::kLearned, "fixed_experts for the learned router");
  LOOM_CHECK(group >= 1 && tokens % group == 0, "router: {} tokens in groups of {}", tokens, group);
  if (c.kind == RouterKind::kHash) {
    std::vector<std::pair<uint64_t, int>> h(static_cast<size_t>(E));
    for (int64_t t = 0; t < tokens; ++t) {
      const uint64_t id = static_cast<uint32_t>(ids[t]);
      for (int e = 0; e < E; ++e)
        h[static_cast<size_t>(e)] = {mix(id * static_cast<uint64_t>(E) + static_cast<uint64_t>(e)),
                                     e};
      std::partial_sort(h.begin(), h.begin() + k, h.end());
      for (int j = 0; j < k; ++j) experts[t * k + j] = h[static_cast<size_t>(j)].second;
    }
    return;
  }
  auto tag_of = [&](int32_t id) {
    const auto it = std::find(c.tag_tokens.begin(), c.tag_tokens.end(), id);
    return it == c.tag_tokens.end() ? -1 : static_cast<int>(it - c.tag_tokens.begin());
  };
  for (int64_t g0 = 0; g0 < tokens; g0 += group) {
    int tag = 0;
    if (g0 == 0)
      for (int64_t t = -history; t < 0; ++t)
        if (const int i = tag_of(ids[t]); i >= 0) tag = i;
    for (int64_t t = g0; t < g0 + group; ++t) {
      if (const int i = tag_of(ids[t]); i >= 0) tag = i;
      for (int j = 0; j < k; ++j) experts[t * k + j] = (tag * k + j) % E;
    }
  }
}

template <typename T>
Routing<T> route_fixed(const int32_t* experts, int64_t tokens, int64_t group,
                       const RouterConfig& c) {
  const int E = c.num_experts, k = c.top_k;
  LOOM_CHECK(E >= 1 && k >= 1 && k <= E, "router: top_k {} of {} experts", k, E);
  LOOM_CHECK(group >= 1 && tokens % group == 0, "router: {} tokens in groups of {}", tokens, group);
  Routing<T> r;
  r.tokens = tokens, r.group = group, r.k = k, r.experts = E;
  r.expert.assign(experts, experts + tokens * k);
  r.gate.assign(static_cast<size_t>(tokens * k), T(1) / T(k));
  r.kept.assign(static_cast<size_t>(tokens * k), 1);
  r.load.assign(static_cast<size_t>(E), 0);
  for (int32_t e : r.expert) {
    LOOM_CHECK(e >= 0 && e < E, "router: expert {} of {}", e, E);
    ++r.load[static_cast<size_t>(e)];
  }
  drop_over_capacity(r, c);  // equal gates: by token, then slot
  return r;
}

template <typename T>
void route_backward(const Routing<T>& r, const T* dgate, double aux_weight, double z_weight,
                    T* dlogits) {
  const int E = r.experts, k = r.k;
  const double groups = double(r.tokens / r.group);
  std::vector<double> dp(static_cast<size_t>(E)), f(static_cast<size_t>(E));
  for (int64_t g0 = 0; g0 < r.tokens; g0 += r.group) {
    // d aux / d probs[t, e] = E f_e / (group x groups), the same for every token of the group.
    std::fill(f.begin(), f.end(), 0.0);
    for (int64_t s = g0 * k; s < (g0 + r.group) * k; ++s)
      f[static_cast<size_t>(r.expert[static_cast<size_t>(s)])] += 1.0 / double(r.group * k);
    for (int64_t t = g0; t < g0 + r.group; ++t) {
      const T* p = r.probs.data() + t * E;
      for (int e = 0; e < E; ++e)
        dp[static_cast<size_t>(e)] =
            aux_weight * double(E) * f[static_cast<size_t>(e)] / (double(r.group) * groups);
      // The gates: g_j = p_j / S over the chosen (k > 1), or p_j (k = 1).
      const size_t at = static_cast<size_t>(t * k);
      if (k == 1) {
        if (r.kept[at]) dp[static_cast<size_t>(r.expert[at])] += double(dgate[at]);
      } else {
        double S = 0, dot = 0;
        for (int j = 0; j < k; ++j) S += double(p[r.expert[at + static_cast<size_t>(j)]]);
        for (int j = 0; j < k; ++j)
          if (r.kept[at + static_cast<size_t>(j)])
            dot += double(dgate[at + static_cast<size_t>(j)]) *
                   double(r.gate[at + static_cast<size_t>(j)]);
        for (int j = 0; j < k; ++j) {
          const double dg = r.kept[at + static_cast<size_t>(j)]
                                ? double(dgate[at + static_cast<size_t>(j)])
                                : 0.0;
          dp[static_cast<size_t>(r.expert[at + static_cast<size_t>(j)])] += (dg - dot) / S;
        }
      }
      // Through the softmax, plus the z-loss's 2 lse softmax / tokens.
      double pdp = 0;
      for (int e = 0; e < E; ++e) pdp += double(p[e]) * dp[static_cast<size_t>(e)];
      const double zg = z_weight * 2.0 * double(r.lse[static_cast<size_t>(t)]) / double(r.tokens);
      for (int e = 0; e < E; ++e)
        dlogits[t * E + e] =
            static_cast<T>(double(p[e]) * (dp[static_cast<size_t>(e)] - pdp) + zg * double(p[e]));
    }
  }
}

template <typename T>
Dispatch dispatch_order(const Routing<T>& r) {
  Dispatch d;
  d.offsets.assign(static_cast<size_t>(r.experts) + 1, 0);
  const int64_t n = r.tokens * r.k;
  for (int64_t s = 0; s < n; ++s)
    if (r.kept[static_cast<size_t>(s)])
      ++d.offsets[static_cast<size_t>(r.expert[static_cast<size_t>(s)]) + 1];
  for (int e = 0; e < r.experts; ++e)
    d.offsets[static_cast<size_t>(e) + 1] += d.offsets[static_cast<size_t>(e)];
  d.slot.resize(static_cast<size_t>(d.offsets.back()));
  std::vector<int64_t> next(d.offsets.begin(), d.offsets.end() - 1);
  // Slots in increasing order: within an expert, by token, then slot.
  for (int64_t s = 0; s < n; ++s)
    if (r.kept[static_cast<size_t>(s)])
      d.slot[static_cast<size_t>(next[static_cast<size_t>(r.expert[static_cast<size_t>(s)])]++)] =
          s;
  return d;
}

template <typename T>
void gather_rows(const Dispatch& d, int k, const T* x, int64_t C, T* rows) {
  for (size_t i = 0; i < d.slot.size(); ++i) {
    const T* src = x + (d.slot[i] / k) * C;
    std::copy(src, src + C, rows + static_cast<int64_t>(i) * C);
  }
}

template <typename T>
void gather_rows_backward(const Dispatch& d, int k, const T* drows, int64_t C, T* dx) {
  for (size_t i = 0; i < d.slot.size(); ++i) {
    T* dst = dx + (d.slot[i] / k) * C;
    const T* g = drows + static_cast<int64_t>(i) * C;
    for (int64_t c = 0; c < C; ++c) dst[c] += g[c];
  }
}

template <typename T>
void combine_rows(const Dispatch& d, const Routing<T>& r, const T* y, int64_t C, T* out) {
  for (size_t i = 0; i < d.slot.size(); ++i) {
    const int64_t s = d.slot[i];
    const T g = r.gate[static_cast<size_t>(s)];
    T* dst = out + (s / r.k) * C;
    const T* src = y + static_cast<int64_t>(i) * C;
    for (int64_t c = 0; c < C; ++c) dst[c] += g * src[c];
  }
}

template <typename T>
void combine_rows_backward(const Dispatch& d, const Routing<T>& r, const T* y, const T* dout,
                           int64_t C, T* dy, T* dgate) {
  std::fill(dgate, dgate + r.tokens * r.k, T(0));
  for (size_t i = 0; i < d.slot.size(); ++i) {
    const int64_t s = d.slot[i];
    const T g = r.gate[static_cast<size_t>(s)];
    const T* go = dout + (s / r.k) * C;
    const T* yi = y + static_cast<int64_t>(i) * C;
    T* dyi = dy + static_cast<int64_t>(i) * C;
    T dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      dyi[c] = g * go[c];
      dot += go[c] * yi[c];
    }
    dgate[s] = dot;
  }
}

template Routing<float> route(const float*, int64_t, int64_t, const RouterConfig&, const float*);
template Routing<double> route(const double*, int64_t, int64_t, const RouterConfig&, const double*);
template Routing<float> route_fixed(const int32_t*, int64_t, int64_t, const RouterConfig&);
template Routing<double> route_fixed(const int32_t*, int64_t, int64_t, const RouterConfig&);
template void route_backward(const Routing<float>&, const float*, double, double, float*);
template void route_backward(const Routing<double>&, const double*, double, double, double*);
#define LOOM_DISPATCH(T)                                                                      \
  template Dispatch dispatch_order(const Routing<T>&);                                        \
  template void gather_rows(const Dispatch&, int, const T*, int64_t, T*);                     \
  template void gather_rows_backward(const Dispatch&, int, const T*, int64_t, T*);            \
  template void combine_rows(const Dispatch&, const Routing<T>&, const T*, int64_t, T*);      \
  template void combine_rows_backward(const Dispatch&, const Routing<T>&, const T*, const T*, \
                                      int64_t, T*, T*);
LOOM_DISPATCH(float)
LOOM_DISPATCH(double)
#undef LOOM_DISPATCH

}  // namespace loom
