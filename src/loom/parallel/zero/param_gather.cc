#include "loom/parallel/zero/param_gather.h"

#include <algorithm>
#include <cstring>

#include "loom/core/error.h"
#include "loom/core/fault.h"

namespace loom {

ParamGatherer::ParamGatherer(ParamStore<float>& store, const ShardLayout& shards,
                             const ZeroConfig& config, const void* shard)
    : store_(store),
      shards_(shards),
      config_(config),
      shard_(static_cast<const char*>(shard)),
      gathered_(static_cast<size_t>(shards.num_units())) {
  for (int u = 0; u < shards.num_units(); ++u)
    persistent_.push_back(shards.unit(u).size() <= config.persistence_threshold);
}

ParamGatherer::~ParamGatherer() {
  for (const Gathered& g : gathered_) wait_quietly(g.work, "a ZeRO parameter gather");
}

void ParamGatherer::launch(int u) {
  Gathered& g = gathered_[static_cast<size_t>(u)];
  if (g.buf.data()) return;
  const size_t es = dtype_size(config_.dtype);
  const int64_t n = shards_.unit(u).size(), slice = shards_.slice(u);
  g.buf = store_.backend().alloc(static_cast<size_t>(n) * es, MemCategory::kComm);
  const char* mine = shard_ + static_cast<size_t>(shards_.shard_offset(u)) * es;
  if (const UnitGroup& ug = shards_.group(u); ug.group) {
    g.work = ug.group->all_gather(mine, g.buf.data(), static_cast<size_t>(slice), config_.dtype);
    fault_point("zero_gather");
  } else {
    std::memcpy(g.buf.data(), mine, static_cast<size_t>(slice) * es);
  }
  elements_ += static_cast<size_t>(n);
  peak_ = std::max(peak_, elements_);
}

const void* ParamGatherer::wait(int u, CommStats* stats) {
  launch(u);
  Gathered& g = gathered_[static_cast<size_t>(u)];
  if (g.work) {
    wait_for_use(g.work, store_.backend(), stats);
    g.work = nullptr;
  }
  return g.buf.data();
}

void ParamGatherer::forget(int u) {
  elements_ -= static_cast<size_t>(shards_.unit(u).size());
  gathered_[static_cast<size_t>(u)] = Gathered{};
}

void ParamGatherer::drop(int u) {
  if (!persistent_[static_cast<size_t>(u)]) forget(u);
}

void ParamGatherer::release(int u) {
  if (persistent_[static_cast<size_t>(u)]) return;
  Gathered& g = gathered_[static_cast<size_t>(u)];
  if (!g.buf.data()) return;
  LOOM_CHECK(g.work == nullptr, "unit {} released while its gather is in flight",
             shards_.unit(u).name);
  store_.bind_params(u, nullptr);
  forget(u);
}

void ParamGatherer::start(const std::vector<UnitUse>& plan) {
  if (config_.prefetch_bucket_size <= 0) return;
  for (const UnitUse& use : plan)
    if (reads_params(use.pass)) {
      for (int w : shards_.used_with(use.unit)) launch(w);
      return;
    }
}

void ParamGatherer::prefetch(const std::vector<UnitUse>& plan, size_t pos, int u) {
  if (config_.prefetch_bucket_size <= 0) return;
  // Units gathered ahead count whether or not their gather has finished.
  int64_t ahead = 0;
  std::vector<bool> seen(gathered_.size(), false);
  seen[static_cast<size_t>(u)] = true;
  for (size_t j = pos + 1; j < plan.size(); ++j) {
    const size_t next = static_cast<size_t>(plan[j].unit);
    if (!reads_params(plan[j].pass) || seen[next]) continue;
    seen[next] = true;
    // A unit and the expert units riding on it count as one.
    int64_t missing = 0;
    for (int v : shards_.used_with(plan[j].unit)) {
      if (!gathered_[static_cast<size_t>(v)].buf.data())
        missing += shards_.unit(v).size();
      else if (!persistent_[static_cast<size_t>(v)])
        ahead += shards_.unit(v).size();
    }
    if (missing == 0) continue;
    if (ahead > 0 && ahead + missing > config_.prefetch_bucket_size) break;
    for (int v : shards_.used_with(plan[j].unit)) launch(v);
    ahead += missing;
  }
}

void ParamGatherer::check_released() const {
  for (int u = 0; u < shards_.num_units(); ++u)
    LOOM_CHECK(persistent_[static_cast<size_t>(u)] || !gathered_[static_cast<size_t>(u)].buf.data(),
               "unit {} still gathered after its micro-batch", shards_.unit(u).name);
}

void ParamGatherer::drop_resident() {
  for (int u = 0; u < shards_.num_units(); ++u) {
    Gathered& g = gathered_[static_cast<size_t>(u)];
    if (!persistent_[static_cast<size_t>(u)] || !g.buf.data()) continue;
    if (g.work) g.work->wait();
    store_.bind_params(u, nullptr);
    forget(u);
  }
}

void ParamGatherer::drop_all() {
  for (int u = 0; u < shards_.num_units(); ++u) {
    Gathered& g = gathered_[static_cast<size_t>(u)];
    if (!g.buf.data()) continue;
    if (g.work) g.work->wait();
    forget(u);
  }
}

}  // namespace loom
