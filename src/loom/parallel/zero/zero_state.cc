// The ZeRO engine's state as checkpoints and tools see it: views of what
// this rank holds, and gathers of the whole.
#include <cstring>

#include "loom/core/error.h"
#include "loom/parallel/zero/zero.h"

namespace loom {

namespace {

size_t f32_bytes(int64_t elements) {
  return static_cast<size_t>(elements) * sizeof(float);
}

}  // namespace

void ZeroEngine::sync_params() {
  if (!half()) return;
  if (packs_) packs_->clear();
  if (config_.stage >= 3) {
    be_.round_16(masters(), params16(), shards_.shard_elements(), config_.dtype);
  } else {
    for (int u = 0; u < num_units(); ++u)
      be_.round_16(masters() + shards_.shard_offset(u), params16() + shards_.slice_begin(u),
                   shards_.slice(u), config_.dtype);
    gather_updated_params();
  }
  if (gatherer_) gatherer_->drop_resident();
  optimizer_->release();
}

void ZeroEngine::gather_full_params() {
  if (full_ || (!half() && config_.stage < 3)) return;
  // 16-bit mode: the masters, what a checkpoint holds (and what sampling at
  // the end of a run computes with). f32: the stage-3 shards.
  const float* mine = half() ? masters() : shard_params();
  store_.allocate_params();
  std::vector<WorkPtr> works;
  for (int u = 0; u < num_units(); ++u) {
    const UnitGroup& g = shards_.group(u);
    const float* slice = mine + shards_.shard_offset(u);
    float* at = store_.params() + unit(u).begin;
    if (g.group && g.shards > 1)
      works.push_back(
          g.group->all_gather(slice, at, static_cast<size_t>(shards_.slice(u)), DType::kF32));
    else
      std::memcpy(at, slice, f32_bytes(shards_.slice(u)));
  }
  wait_all(works);
  optimizer_->release();
  full_ = true;
}

void ZeroEngine::release_full_params(bool keep_changes) {
  if (!full_) return;
  // This rank's slices back into the masters (16-bit) or the shard (f32).
  if (keep_changes) {
    float* mine = half() ? masters() : shard_params();
    for (int u = 0; u < num_units(); ++u)
      std::memcpy(mine + shards_.shard_offset(u), store_.params() + shards_.slice_begin(u),
                  f32_bytes(shards_.slice(u)));
  }
  store_.release_params();
  full_ = false;
  if (half()) {
    if (keep_changes) sync_params();
    return;
  }
  // Gathered copies (resident units) may be stale now.
  gatherer_->drop_all();
}

std::vector<float> ZeroEngine::gather_grads() {
  std::vector<float> out(static_cast<size_t>(store_.num_params()), 0.0f);
  const float f = grad_factor_;  // 16-bit mode: the factor still pending
  // n elements of the reduced gradients from element `at` of what this rank
  // holds, widened and scaled to the values the optimizer will use.
  auto read = [&](int64_t at, int64_t n, float* dst) {
    if (half()) {
      be_.widen_16(grads16() + at, dst, n, config_.dtype);
      be_.scale(dst, n, f);
    } else {
      std::memcpy(dst, held_grads() + at, f32_bytes(n));
    }
  };
  if (config_.stage < 2) {
    read(0, store_.num_params(), out.data());
    return out;
  }
  std::vector<WorkPtr> works;
  std::vector<std::vector<float>> slices(static_cast<size_t>(num_units()));
  for (int u = 0; u < num_units(); ++u) {
    std::vector<float>& mine = slices[static_cast<size_t>(u)];
    mine.resize(static_cast<size_t>(shards_.slice(u)));
    read(shards_.shard_offset(u), shards_.slice(u), mine.data());
    float* at = out.data() + unit(u).begin;
    if (const UnitGroup& g = shards_.group(u); g.group && g.shards > 1)
      works.push_back(g.group->all_gather(mine.data(), at, mine.size(), DType::kF32));
    else
      std::memcpy(at, mine.data(), f32_bytes(shards_.slice(u)));
  }
  wait_all(works);
  return out;
}

void ZeroEngine::gather_moments(std::vector<float>& m, std::vector<float>& v) {
  const size_t total = static_cast<size_t>(store_.num_params());
  m.assign(total, 0.0f);
  v.assign(total, 0.0f);
  std::vector<WorkPtr> works;
  for (int u = 0; u < num_units(); ++u) {
    const size_t n = static_cast<size_t>(shards_.slice(u));
    const float* sm = optimizer_->exp_avg() + shards_.shard_offset(u);
    const float* sv = optimizer_->exp_avg_sq() + shards_.shard_offset(u);
    if (const UnitGroup& g = shards_.group(u); g.group && g.shards > 1) {
      works.push_back(g.group->all_gather(sm, m.data() + unit(u).begin, n, DType::kF32));
      works.push_back(g.group->all_gather(sv, v.data() + unit(u).begin, n, DType::kF32));
    } else {
      std::memcpy(m.data() + shards_.slice_begin(u), sm, f32_bytes(shards_.slice(u)));
      std::memcpy(v.data() + shards_.slice_begin(u), sv, f32_bytes(shards_.slice(u)));
    }
  }
  wait_all(works);
  optimizer_->release();
}

void ZeroEngine::load_moments(const float* m, const float* v) {
  for (int u = 0; u < num_units(); ++u) {
    const size_t n = f32_bytes(shards_.slice(u));
    std::memcpy(optimizer_->exp_avg() + shards_.shard_offset(u), m + shards_.slice_begin(u), n);
    std::memcpy(optimizer_->exp_avg_sq() + shards_.shard_offset(u), v + shards_.slice_begin(u), n);
  }
  optimizer_->release();
}

std::vector<ZeroEngine::StateRange> ZeroEngine::held(State s) const {
  std::vector<StateRange> out;
  if (s == State::kGrads) {
    // Whole in the model's buffer at stages 0-1, this rank's slices from 2.
    const bool sharded = config_.stage >= 2;
    for (int u = 0; u < num_units(); ++u) {
      const int64_t b = sharded ? shards_.slice_begin(u) : unit(u).begin;
      const int64_t e = sharded ? b + shards_.slice(u) : unit(u).end;
      const int64_t at = sharded ? shards_.shard_offset(u) : unit(u).begin;
      StateRange r{b, e, nullptr};
      if (half())
        r.data16 = grads16() + at;
      else
        r.data = held_grads() + at;
      out.push_back(r);
    }
    return out;
  }
  const std::vector<StateRange> mine = share(s);
  for (int u = 0; u < num_units(); ++u) {
    // 16-bit mode: the parameters are the masters, held like the moments.
    const bool whole =
        s == State::kParams && !half() ? config_.stage < 3 : shards_.group(u).shards == 1;
    if (!whole) {
      out.push_back(mine[static_cast<size_t>(u)]);
      continue;
    }
    const int64_t off = shards_.shard_offset(u);
    float* base = s == State::kParams ? (half() ? masters() + off : store_.params() + unit(u).begin)
                  : s == State::kExpAvg ? optimizer_->exp_avg() + off
                                        : optimizer_->exp_avg_sq() + off;
    out.push_back({unit(u).begin, unit(u).end, base});
  }
  return out;
}

std::vector<ZeroEngine::StateRange> ZeroEngine::share(State s) const {
  LOOM_CHECK(s != State::kGrads, "gradients are not part of a checkpoint");
  std::vector<StateRange> out;
  for (int u = 0; u < num_units(); ++u) {
    int64_t b = shards_.slice_begin(u), e = b + shards_.slice(u);
    if (const UnitGroup& g = shards_.group(u); g.shards == 1) {
      // Not sharded: an equal part for each rank.
      b = unit(u).begin + unit(u).size() * g.rank / g.size;
      e = unit(u).begin + unit(u).size() * (g.rank + 1) / g.size;
    }
    // Where element b is: the model's buffer or this rank's shard.
    const int64_t in_shard = shards_.shard_offset(u) + (b - shards_.slice_begin(u));
    float* base = nullptr;
    if (s == State::kParams && half())
      base = masters() + in_shard;
    else if (s == State::kParams)
      base = config_.stage < 3 ? store_.params() + b : shard_params() + in_shard;
    else
      base = (s == State::kExpAvg ? optimizer_->exp_avg() : optimizer_->exp_avg_sq()) + in_shard;
    out.push_back({b, e, base});
  }
  return out;
}

void ZeroEngine::release_offloaded() {
  optimizer_->release();
}

size_t ZeroEngine::optimizer_resident_bytes() const {
  return optimizer_->resident_bytes();
}

}  // namespace loom
