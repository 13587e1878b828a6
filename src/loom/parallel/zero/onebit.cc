#include "loom/parallel/zero/onebit.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "loom/core/error.h"

namespace loom {

namespace {

size_t f32_bytes(int64_t elements) {
  return static_cast<size_t>(elements) * sizeof(float);
}

}  // namespace

int64_t zero_one_variance_updates(int64_t t, int64_t var_freeze_step, int64_t scaler) {
  // Updates at steps 1, 2, ..., scaler (interval 1), then scaler more at
  // interval 2, then at 4, ...
  int64_t at = 1, interval = 1, count = 0, in_interval = 0;
  const int64_t last = std::min(t, var_freeze_step);
  while (at <= last) {
    ++count;
    if (++in_interval == scaler) in_interval = 0, interval *= 2;
    at += interval;
  }
  return count;
}

bool zero_one_variance_step(int64_t t, int64_t var_freeze_step, int64_t scaler) {
  return t >= 1 && zero_one_variance_updates(t, var_freeze_step, scaler) !=
                       zero_one_variance_updates(t - 1, var_freeze_step, scaler);
}

bool OneBitAdam::compressed(int64_t step) const {
  if (!optimizer_.zero_one()) return step > optimizer_.freeze_step;
  return !zero_one_variance_step(step, optimizer_.var_freeze_step, optimizer_.var_update_scaler);
}

OneBitAdam::OneBitAdam(const ShardLayout& shards, const ZeroConfig& zero,
                       const OptimizerConfig& optimizer, const Backend<float>& backend)
    : shards_(shards), zero_(zero), optimizer_(optimizer), be_(backend) {
  LOOM_CHECK_KIND(kConfig, zero.stage == 0,
                  "optimizer.type {} needs zero_optimization.stage 0, got {}", optimizer.type,
                  zero.stage);
  // Tests only: LOOM_TEST_CODEC=identity runs the same path uncompressed.
  const char* test_codec = std::getenv("LOOM_TEST_CODEC");
  const Codec codec =
      test_codec && std::string(test_codec) == "identity" ? Codec::kIdentity : Codec::kSign;
  for (int u = 0; u < shards.num_units(); ++u) {
    const UnitGroup& g = shards.group(u);
    units_.push_back(g.group ? std::make_unique<CompressedAllReduce>(
                                   g.group, static_cast<size_t>(shards.unit(u).size()), codec)
                             : nullptr);
  }
}

void OneBitAdam::unit_step(int u, const float* g, float* params, float* m, float* v, double lr,
                           int64_t step) {
  const Unit& un = shards_.unit(u);
  const int64_t b = un.begin, n = un.size();
  const double b1 = optimizer_.beta1, b2 = optimizer_.beta2;
  if (!compressed(step)) {
    // 0/1 Adam's variance step: AdamW's moments from the reduced gradients.
    for (int64_t i = 0; i < n; ++i) {
      m[b + i] = static_cast<float>(b1 * m[b + i] + (1 - b1) * g[i]);
      v[b + i] = static_cast<float>(b2 * v[b + i] + (1 - b2) * double(g[i]) * g[i]);
    }
  } else {
    // This rank's momentum, masked where the second moment is zero.
    Buffer xb = be_.alloc(f32_bytes(n), MemCategory::kComm, false);
    float* x = xb.as<float>();
    for (int64_t i = 0; i < n; ++i)
      x[i] = v[b + i] == 0.0f ? 0.0f : static_cast<float>(b1 * m[b + i] + (1 - b1) * g[i]);
    if (CompressedAllReduce* ca = units_[static_cast<size_t>(u)].get()) {
      ca->run(x, m + b);
      // Masked elements carry no momentum and no error; nor does the padding.
      for (int64_t i = 0; i < n; ++i)
        if (v[b + i] == 0.0f) m[b + i] = 0.0f;
      if (ca->codec() == Codec::kSign) {
        float* ew = ca->worker_error();
        float* es = ca->server_error();
        const int64_t C = static_cast<int64_t>(ca->chunk());
        const int64_t first = shards_.group(u).rank * C;
        for (int64_t i = 0; i < n; ++i)
          if (v[b + i] == 0.0f) ew[i] = 0.0f;
        std::fill(ew + n, ew + ca->padded(), 0.0f);
        for (int64_t j = 0; j < C; ++j)
          if (first + j >= n || v[b + first + j] == 0.0f) es[j] = 0.0f;
      }
      const int W = shards_.group(u).size;
      // The all-to-all's blocks to the others, and the all-gather's.
      stats_.sent_bytes += 2.0 * (W - 1) * double(ca->block_bytes());
      stats_.plain_bytes += all_reduce_volume(double(n) * double(dtype_size(zero_.dtype)), W);
    } else {
      std::memcpy(m + b, x, f32_bytes(n));
    }
  }
  // AdamW's update with the second moment as it stands: frozen at the
  // freeze step (1-bit Adam), or after its updates so far (0/1 Adam).
  const int64_t v_updates =
      optimizer_.zero_one()
          ? zero_one_variance_updates(step, optimizer_.var_freeze_step, optimizer_.var_update_scaler)
          : optimizer_.freeze_step;
  const double c1 = 1 - std::pow(b1, double(step));
  const double c2 = 1 - std::pow(b2, double(v_updates));
  const auto [first, last] = shards_.unit_segments(u);
  for (size_t k = first; k < last; ++k) {
    const AdamWSegment& s = shards_.segments()[k];
    const double wd = s.decay ? optimizer_.weight_decay : 0.0;
    float* p = params + s.param_offset;
    const float* ms = m + s.state_offset;
    const float* vs = v + s.state_offset;
    for (int64_t i = 0; i < s.length; ++i) {
      const double pi = p[i];
      const double upd = (ms[i] / c1) / (std::sqrt(vs[i] / c2) + optimizer_.eps) + wd * pi;
      p[i] = static_cast<float>(pi - lr * upd);
    }
  }
}

void OneBitAdam::step(float* params, const float* grads, float* m, float* v, double lr,
                      int64_t step) {
  for (int u = 0; u < shards_.num_units(); ++u)
    unit_step(u, grads + shards_.unit(u).begin, params, m, v, lr, step);
}

void OneBitAdam::step_16(float* masters, uint16_t* params16, const uint16_t* grads16, DType t,
                         float grad_factor, float* m, float* v, double lr, int64_t step) {
  for (int u = 0; u < shards_.num_units(); ++u) {
    const Unit& un = shards_.unit(u);
    Buffer g = be_.alloc(f32_bytes(un.size()), MemCategory::kComm, false);
    be_.widen_16(grads16 + un.begin, g.as<float>(), un.size(), t);
    if (grad_factor != 1.0f) be_.scale(g.as<float>(), un.size(), grad_factor);
    unit_step(u, g.as<float>(), masters, m, v, lr, step);
    be_.round_16(masters + un.begin, params16 + un.begin, un.size(), t);
  }
}

std::vector<CompressionState> OneBitAdam::state() {
  std::vector<CompressionState> out;
  for (int u = 0; u < shards_.num_units(); ++u) {
    CompressedAllReduce* ca = units_[static_cast<size_t>(u)].get();
    if (!ca || ca->codec() != Codec::kSign) continue;
    const int64_t b = shards_.unit(u).begin, C = static_cast<int64_t>(ca->chunk());
    const int64_t first = shards_.group(u).rank * C;
    for (const Param& p : shards_.layout().params()) {
      if (p.unit != u) continue;
      const int64_t at = p.offset - b;  // in the unit
      const int64_t rows = p.local.rank() >= 1 ? p.local[0] : 1;
      out.push_back({CompressionState::kError, "onebit", &p, ca->worker_error() + at, rows,
                     p.numel / rows});
      const int64_t lo = std::max(at, first), hi = std::min(at + p.numel, first + C);
      CompressionState s{CompressionState::kServerError, "onebit", &p, nullptr};
      s.begin = std::min(lo, hi) - at;
      s.end = hi - at;
      s.data = ca->server_error() + (std::min(lo, hi) - first);
      if (lo < hi) out.push_back(s);
    }
  }
  return out;
}

}  // namespace loom
