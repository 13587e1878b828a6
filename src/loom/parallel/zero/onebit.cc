#include "loom/parallel/zero/onebit.h"

#include <algorithm>
#include <chrono>
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

int64_t zero_one_local_interval(int64_t t, int64_t var_freeze_step, int64_t scaler,
                                int64_t clipper) {
  if (t <= var_freeze_step) return 1;
  int64_t interval = 1;
  for (int64_t doublings = (t - var_freeze_step - 1) / scaler; doublings > 0 && interval < clipper;
       --doublings)
    interval *= 2;
  return std::min(interval, clipper);
}

bool OneBitAdam::local(int64_t step, bool sync) const {
  if (!optimizer_.zero_one() || !compressed(step)) return false;
  const int64_t interval =
      zero_one_local_interval(step, optimizer_.var_freeze_step, optimizer_.local_step_scaler,
                              optimizer_.local_step_clipper);
  return interval > 1 && !sync && step % interval != 0;
}

bool OneBitAdam::compressed(int64_t step) const {
  if (!optimizer_.zero_one()) return step > optimizer_.freeze_step;
  return !zero_one_variance_step(step, optimizer_.var_freeze_step, optimizer_.var_update_scaler);
}

OneBitAdam::OneBitAdam(const ShardLayout& shards, const ZeroConfig& zero,
                       const OptimizerConfig& optimizer, const Backend<float>& backend)
    : shards_(shards), zero_(zero), optimizer_(optimizer), be_(backend) {
  LOOM_CHECK_KIND(kConfig, zero.stage <= 1,
                  "optimizer.type {} needs zero_optimization.stage 0 or 1, got {}", optimizer.type,
                  zero.stage);
  // Tests only: LOOM_TEST_CODEC=identity runs the same path uncompressed.
  const char* test_codec = std::getenv("LOOM_TEST_CODEC");
  const Codec codec =
      test_codec && std::string(test_codec) == "identity" ? Codec::kIdentity : Codec::kSign;
  of_unit_.resize(static_cast<size_t>(shards.num_units()));
  for (int u = 0; u < shards.num_units(); ++u) {
    Segment rest{u, {}, 0, nullptr};
    for (const Param& p : shards.layout().params()) {
      if (p.unit != u) continue;
      if (p.matrix()) {
        of_unit_[static_cast<size_t>(u)].push_back(segments_.size());
        segments_.push_back({u, {{p.offset, p.offset + p.numel}}, p.numel, nullptr});
      } else {
        rest.ranges.push_back({p.offset, p.offset + p.numel});
        rest.size += p.numel;
      }
    }
    if (rest.size > 0) {
      of_unit_[static_cast<size_t>(u)].push_back(segments_.size());
      segments_.push_back(std::move(rest));
    }
  }
  for (Segment& seg : segments_) {
    const UnitGroup& g = shards.group(seg.unit);
    if (g.group)
      seg.ca = std::make_unique<CompressedAllReduce>(g.group, static_cast<size_t>(seg.size), codec);
  }
}

void OneBitAdam::compress(Segment& seg, const float* g, int64_t unit_begin, float* m,
                          const float* v, const float* acc, float inv_l) {
  const float b1 = static_cast<float>(optimizer_.beta1), c = 1.0f - b1;
  // Stage 1 holds v of its slices only: the gathered mask says where it is zero.
  const uint8_t* mask = sharded() ? mask_.as<uint8_t>() : nullptr;
  auto masked = [&](int64_t i) { return mask ? mask[i] != 0 : v[i] == 0.0f; };
  // This rank's momentum of the segment (or its interval's lr-weighted
  // mean), gathered, masked where the second moment is zero.
  Buffer xb = be_.alloc(f32_bytes(seg.size), MemCategory::kComm, false);
  float* x = xb.as<float>();
  int64_t k = 0;
  for (const auto& [lo, hi] : seg.ranges) {
    if (acc) {
      for (int64_t i = lo; i < hi; ++i, ++k) x[k] = masked(i) ? 0.0f : acc[i] * inv_l;
      continue;
    }
    const float* gs = g + (lo - unit_begin);
    for (int64_t i = lo; i < hi; ++i, ++k) x[k] = masked(i) ? 0.0f : b1 * m[i] + c * gs[i - lo];
  }
  CompressedAllReduce* ca = seg.ca.get();
  if (ca) comm_s_ += ca->run(x, x);
  // Back into m; masked elements carry no momentum and no error, nor does
  // the padding.
  k = 0;
  float* ew = ca && ca->codec() == Codec::kSign ? ca->worker_error() : nullptr;
  for (const auto& [lo, hi] : seg.ranges)
    for (int64_t i = lo; i < hi; ++i, ++k) {
      const bool off = masked(i);
      m[i] = off ? 0.0f : x[k];
      if (ew && off) ew[k] = 0.0f;
    }
  if (!ca) return;
  if (ew) {
    std::fill(ew + seg.size, ew + ca->padded(), 0.0f);
    // The server's chunk: masked elements and the padding.
    float* es = ca->server_error();
    const int64_t C = static_cast<int64_t>(ca->chunk());
    const int64_t first = shards_.group(seg.unit).rank * C;
    k = 0;
    for (const auto& [lo, hi] : seg.ranges)
      for (int64_t i = lo; i < hi; ++i, ++k)
        if (k >= first && k < first + C && masked(i)) es[k - first] = 0.0f;
    for (int64_t j = std::max<int64_t>(0, seg.size - first); j < C; ++j) es[j] = 0.0f;
  }
  const int W = shards_.group(seg.unit).size;
  // The all-to-all's blocks to the others, and the all-gather's.
  stats_.sent_bytes += 2.0 * (W - 1) * double(ca->block_bytes());
  stats_.plain_bytes += all_reduce_volume(double(seg.size) * double(dtype_size(zero_.dtype)), W);
}

void OneBitAdam::update(int u, float* params, const float* from, bool by_state, const float* m,
                        const float* v, float lr, int64_t step) {
  const double b1 = optimizer_.beta1, b2 = optimizer_.beta2;
  // The second moment as it stands: frozen at the freeze step (1-bit Adam),
  // or after its updates so far (0/1 Adam).
  const int64_t v_updates = optimizer_.zero_one()
                                ? zero_one_variance_updates(step, optimizer_.var_freeze_step,
                                                            optimizer_.var_update_scaler)
                                : optimizer_.freeze_step;
  LOOM_CHECK(v_updates >= 1, "a 1-bit step {} before any update of the variance", step);
  const double c1 = 1 - std::pow(b1, double(step));
  const double c2 = 1 - std::pow(b2, double(v_updates));
  // In f32, as the AdamW kernels: m / c1 / (sqrt(v) / sqrt(c2) + eps).
  const float inv_c1 = static_cast<float>(1.0 / c1),
              inv_sqrt_c2 = static_cast<float>(1.0 / std::sqrt(c2));
  const float eps = static_cast<float>(optimizer_.eps);
  const auto [first, last] = shards_.unit_segments(u);
  for (size_t k = first; k < last; ++k) {
    const AdamWSegment& s = shards_.segments()[k];
    const float wd = s.decay ? static_cast<float>(optimizer_.weight_decay) : 0.0f;
    const int64_t at = by_state ? s.state_offset : s.param_offset;
    float* p = params + at;
    const float* p0 = from + at;
    const float* ms = m + s.param_offset;
    const float* vs = v + s.state_offset;
    for (int64_t i = 0; i < s.length; ++i)
      p[i] = p0[i] - lr * (ms[i] * inv_c1 / (std::sqrt(vs[i]) * inv_sqrt_c2 + eps) + wd * p0[i]);
  }
}

void OneBitAdam::unit_step(int u, const float* g, float* params, float* m, float* v, double lr,
                           int64_t step, bool sync) {
  const Unit& un = shards_.unit(u);
  const int64_t b = un.begin, n = un.size();
  const double b1 = optimizer_.beta1, b2 = optimizer_.beta2;
  if (optimizer_.zero_one() && compressed(step) &&
      zero_one_local_interval(step, optimizer_.var_freeze_step, optimizer_.local_step_scaler,
                              optimizer_.local_step_clipper) > 1) {
    local_unit_step(u, g, params, m, v, lr, step, sync);
    return;
  }
  if (!compressed(step)) {
    // 0/1 Adam's variance step: AdamW's moments from the reduced gradients.
    for (int64_t i = 0; i < n; ++i) {
      m[b + i] = static_cast<float>(b1 * m[b + i] + (1 - b1) * g[i]);
      v[b + i] = static_cast<float>(b2 * v[b + i] + (1 - b2) * double(g[i]) * g[i]);
    }
  } else {
    for (size_t k : of_unit_[static_cast<size_t>(u)]) compress(segments_[k], g, b, m, v);
  }
  update(u, params, params, false, m, v, static_cast<float>(lr), step);
}

void OneBitAdam::sharded_unit_step(int u, const float* g, float* params, bool masters,
                                   float* m_shard, float* v_shard, double lr, int64_t step) {
  const Unit& un = shards_.unit(u);
  const int64_t b = un.begin, n = un.size();
  const double b1 = optimizer_.beta1, b2 = optimizer_.beta2;
  float* m = m_full_.as<float>();
  const auto [first, last] = shards_.unit_segments(u);
  if (!compressed(step)) {
    // 0/1 Adam's variance step: the whole momentum from the reduced
    // gradients, the variance of this rank's slices.
    for (int64_t i = 0; i < n; ++i) m[b + i] = static_cast<float>(b1 * m[b + i] + (1 - b1) * g[i]);
    for (size_t k = first; k < last; ++k) {
      const AdamWSegment& s = shards_.segments()[k];
      for (int64_t j = 0; j < s.length; ++j) {
        const double gj = g[s.param_offset - b + j];
        float& vj = v_shard[s.state_offset + j];
        vj = static_cast<float>(b2 * vj + (1 - b2) * gj * gj);
      }
    }
    mask_ready_ = false;
  } else {
    for (size_t k : of_unit_[static_cast<size_t>(u)]) compress(segments_[k], g, b, m, nullptr);
  }
  // This rank's slices updated (the engine gathers the parameters), and
  // their momentum kept in the shard (checkpoints save it).
  update(u, params, params, masters, m, v_shard, static_cast<float>(lr), step);
  for (size_t k = first; k < last; ++k) {
    const AdamWSegment& s = shards_.segments()[k];
    std::memcpy(m_shard + s.state_offset, m + s.param_offset, f32_bytes(s.length));
  }
}

void OneBitAdam::gather_state(const float* m_shard, const float* v_shard, int64_t step) {
  const int64_t total = shards_.layout().total();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<WorkPtr> works;
  std::vector<Buffer> slices;
  if (!m_ready_) {
    // Every rank's momentum is the same: the whole of it from the slices.
    if (!m_full_.data()) m_full_ = be_.alloc(f32_bytes(total), MemCategory::kOptimizer);
    for (int u = 0; u < shards_.num_units(); ++u) {
      const UnitGroup& g = shards_.group(u);
      const float* in = m_shard + shards_.shard_offset(u);
      float* out = m_full_.as<float>() + shards_.unit(u).begin;
      if (!g.group) {
        std::memcpy(out, in, f32_bytes(shards_.slice(u)));
        continue;
      }
      works.push_back(
          g.group->all_gather(in, out, static_cast<size_t>(shards_.slice(u)), DType::kF32));
    }
    m_ready_ = true;
  }
  if (compressed(step) && !mask_ready_) {
    // Where the variance is zero (gradients that were always zero, the
    // padding), one byte per element gathered from the slices.
    if (!mask_.data()) mask_ = be_.alloc(static_cast<size_t>(total), MemCategory::kOptimizer);
    for (int u = 0; u < shards_.num_units(); ++u) {
      const UnitGroup& g = shards_.group(u);
      const int64_t n = shards_.slice(u);
      Buffer s = be_.alloc(static_cast<size_t>(n), MemCategory::kComm, false);
      const float* v = v_shard + shards_.shard_offset(u);
      for (int64_t j = 0; j < n; ++j) s.as<uint8_t>()[j] = v[j] == 0.0f;
      uint8_t* out = mask_.as<uint8_t>() + shards_.unit(u).begin;
      if (!g.group) {
        std::memcpy(out, s.data(), static_cast<size_t>(n));
        continue;
      }
      works.push_back(g.group->all_gather(s.data(), out, static_cast<size_t>(n), DType::kU8));
      stats_.sent_bytes += spread_volume(double(n) * g.size, g.size);
      slices.push_back(std::move(s));
    }
    mask_ready_ = true;
  }
  for (WorkPtr& w : works) w->wait();
  comm_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void OneBitAdam::local_unit_step(int u, const float* g, float* params, float* m, const float* v,
                                 double lr, int64_t step, bool sync) {
  const Unit& un = shards_.unit(u);
  const int64_t b = un.begin, n = un.size();
  const int64_t total = shards_.layout().total();
  if (!start_.data()) {
    start_ = be_.alloc(f32_bytes(total), MemCategory::kOptimizer);
    acc_ = be_.alloc(f32_bytes(total), MemCategory::kOptimizer);
  }
  float* p0 = start_.as<float>();
  float* acc = acc_.as<float>();
  if (opens_) {
    std::memcpy(p0 + b, params + b, f32_bytes(n));
    std::memset(acc + b, 0, f32_bytes(n));
  }
  // This rank's momentum from its own gradients; masked elements keep none.
  const float b1 = static_cast<float>(optimizer_.beta1), c = 1.0f - b1;
  const float lrf = static_cast<float>(lr);
  for (int64_t i = 0; i < n; ++i) {
    m[b + i] = v[b + i] == 0.0f ? 0.0f : b1 * m[b + i] + c * g[i];
    acc[b + i] += lrf * m[b + i];
  }
  if (!sync) {
    update(u, params, params, false, m, v, lrf, step);
    // What the plain reduction would have sent this step; nothing was.
    const int W = shards_.group(u).size;
    if (shards_.group(u).group)
      for (size_t k : of_unit_[static_cast<size_t>(u)])
        stats_.plain_bytes +=
            all_reduce_volume(double(segments_[k].size) * double(dtype_size(zero_.dtype)), W);
    return;
  }
  close_unit(u, params, m, v, step);
}

void OneBitAdam::close_unit(int u, float* params, float* m, const float* v, int64_t step) {
  // The interval's lr-weighted mean momentum (the current one if every lr
  // was zero), averaged; the interval's update from its start.
  const bool weighted = lr_sum_ > 0;
  const float inv_l = weighted ? static_cast<float>(1.0 / lr_sum_) : 1.0f;
  const int64_t b = shards_.unit(u).begin;
  for (size_t k : of_unit_[static_cast<size_t>(u)])
    compress(segments_[k], nullptr, b, m, v, weighted ? acc_.as<float>() : m, inv_l);
  update(u, params, start_.as<float>(), false, m, v, static_cast<float>(lr_sum_), step);
}

void OneBitAdam::settle(float* params, float* m, float* v, int64_t step) {
  if (!open_) return;
  for (int u = 0; u < shards_.num_units(); ++u) close_unit(u, params, m, v, step);
  last_local_ = false;
  end_step(true);
}

void OneBitAdam::settle_16(float* masters, uint16_t* params16, DType t, float* m, float* v,
                           int64_t step) {
  if (!open_) return;
  for (int u = 0; u < shards_.num_units(); ++u) {
    const Unit& un = shards_.unit(u);
    close_unit(u, masters, m, v, step);
    be_.round_16(masters + un.begin, params16 + un.begin, un.size(), t);
  }
  last_local_ = false;
  end_step(true);
}

bool OneBitAdam::begin_step(double lr, int64_t step, bool sync) {
  const bool interval =
      optimizer_.zero_one() && compressed(step) &&
      zero_one_local_interval(step, optimizer_.var_freeze_step, optimizer_.local_step_scaler,
                              optimizer_.local_step_clipper) > 1;
  last_local_ = local(step, sync);
  if (!interval) return false;
  LOOM_CHECK_KIND(kConfig, !sharded(),
                  "optimizer.type ZeroOneAdam's local steps need zero_optimization.stage 0: "
                  "each rank updates all of its own parameters between synchronisations");
  opens_ = !open_;
  open_ = true;
  lr_sum_ += lr;
  return !last_local_;
}

void OneBitAdam::end_step(bool syncs) {
  if (!syncs) return;
  open_ = false;
  lr_sum_ = 0;
}

void OneBitAdam::step(float* params, const float* grads, float* m, float* v, double lr,
                      int64_t step, bool sync) {
  const bool syncs = begin_step(lr, step, sync);
  if (sharded()) {
    gather_state(m, v, step);
    for (int u = 0; u < shards_.num_units(); ++u)
      sharded_unit_step(u, grads + shards_.unit(u).begin, params, false, m, v, lr, step);
    return;
  }
  for (int u = 0; u < shards_.num_units(); ++u)
    unit_step(u, grads + shards_.unit(u).begin, params, m, v, lr, step, syncs);
  end_step(syncs);
}

void OneBitAdam::step_16(float* masters, uint16_t* params16, const uint16_t* grads16, DType t,
                         float grad_factor, float* m, float* v, double lr, int64_t step,
                         bool sync) {
  const bool syncs = begin_step(lr, step, sync);
  if (sharded()) gather_state(m, v, step);
  for (int u = 0; u < shards_.num_units(); ++u) {
    const Unit& un = shards_.unit(u);
    Buffer g = be_.alloc(f32_bytes(un.size()), MemCategory::kComm, false);
    be_.widen_16(grads16 + un.begin, g.as<float>(), un.size(), t);
    if (grad_factor != 1.0f) be_.scale(g.as<float>(), un.size(), grad_factor);
    if (!sharded()) {
      unit_step(u, g.as<float>(), masters, m, v, lr, step, syncs);
      be_.round_16(masters + un.begin, params16 + un.begin, un.size(), t);
      continue;
    }
    // Stage 1: this rank's slices of the masters, rounded into the parameters.
    sharded_unit_step(u, g.as<float>(), masters, true, m, v, lr, step);
    const auto [first, last] = shards_.unit_segments(u);
    for (size_t k = first; k < last; ++k) {
      const AdamWSegment& s = shards_.segments()[k];
      be_.round_16(masters + s.state_offset, params16 + s.param_offset, s.length, t);
    }
  }
  end_step(syncs);
}

std::vector<CompressionState> OneBitAdam::state() {
  std::vector<CompressionState> out;
  for (Segment& seg : segments_) {
    CompressedAllReduce* ca = seg.ca.get();
    if (!ca || ca->codec() != Codec::kSign) continue;
    const int64_t C = static_cast<int64_t>(ca->chunk());
    const int64_t first = shards_.group(seg.unit).rank * C;
    int64_t at = 0;  // the range's place in the segment
    for (const auto& [lo, hi] : seg.ranges) {
      const Param* p = nullptr;
      for (const Param& q : shards_.layout().params())
        if (q.offset == lo) p = &q;
      LOOM_CHECK(p && hi - lo == p->numel, "a 1-bit segment range is not a parameter");
      const int64_t rows = p->local.rank() >= 1 ? p->local[0] : 1;
      out.push_back(
          {CompressionState::kError, "onebit", p, ca->worker_error() + at, rows, p->numel / rows});
      // The part of it this rank serves.
      const int64_t b = std::max(at, first), e = std::min(at + p->numel, first + C);
      if (b < e) {
        CompressionState s{CompressionState::kServerError, "onebit", p,
                           ca->server_error() + (b - first)};
        s.begin = b - at;
        s.end = e - at;
        out.push_back(s);
      }
      at += p->numel;
    }
  }
  return out;
}

}  // namespace loom
