#include "loom/parallel/expert/all_to_all.h"

#include <chrono>
#include <cstring>

#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom::ep {

namespace {

// Rank s's rows for this rank's local expert e, by (s, e).
int64_t count(const ExpertPlan& p, int me, int s, int e) {
  const int E = p.ranks * p.local;
  return p.counts[static_cast<size_t>(s * E + me * p.local + e)];
}

}  // namespace

AllToAllDispatcher::AllToAllDispatcher(std::shared_ptr<ProcessGroup> group, DType payload,
                                       const Backend<float>* backend)
    : group_(std::move(group)),
      payload_(payload),
      be_(backend ? backend : &default_backend<float>()) {
  LOOM_CHECK(group_ && group_->size() > 1, "an expert-parallel dispatcher needs a group");
  LOOM_CHECK(payload_ == DType::kF32 || payload_ == DType::kBF16 || payload_ == DType::kF16,
             "expert all-to-all rows travel in f32, bf16 or f16");
}

ExpertPlan AllToAllDispatcher::plan(const std::vector<int64_t>& rows_per_expert, int experts) {
  const int P = ranks(), me = rank();
  LOOM_CHECK(experts % P == 0 && rows_per_expert.size() == static_cast<size_t>(experts),
             "a dispatch plan of {} counts for {} experts over {} ranks", rows_per_expert.size(),
             experts, P);
  const auto t0 = std::chrono::steady_clock::now();
  ExpertPlan p;
  p.ranks = P;
  p.local = experts / P;
  p.counts = all_gather_words(*group_, rows_per_expert.data(), rows_per_expert.size());
  stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  p.offsets.assign(static_cast<size_t>(p.local) + 1, 0);
  for (int e = 0; e < p.local; ++e) {
    int64_t n = 0;
    for (int s = 0; s < P; ++s) n += count(p, me, s, e);
    p.offsets[static_cast<size_t>(e) + 1] = p.offsets[static_cast<size_t>(e)] + n;
  }
  return p;
}

std::vector<size_t> AllToAllDispatcher::sent(const ExpertPlan& p) const {
  const int E = p.ranks * p.local, me = rank();
  std::vector<size_t> n(static_cast<size_t>(p.ranks), 0);
  for (int j = 0; j < p.ranks; ++j)
    for (int e = 0; e < p.local; ++e)
      n[static_cast<size_t>(j)] +=
          static_cast<size_t>(p.counts[static_cast<size_t>(me * E + j * p.local + e)]);
  return n;
}

std::vector<size_t> AllToAllDispatcher::received(const ExpertPlan& p) const {
  std::vector<size_t> n(static_cast<size_t>(p.ranks), 0);
  for (int s = 0; s < p.ranks; ++s)
    for (int e = 0; e < p.local; ++e)
      n[static_cast<size_t>(s)] += static_cast<size_t>(count(p, rank(), s, e));
  return n;
}

void AllToAllDispatcher::exchange(const float* in, const std::vector<size_t>& send, float* out,
                                  const std::vector<size_t>& recv, int64_t C) {
  std::vector<size_t> s(send.size()), r(recv.size());
  size_t ns = 0, nr = 0;
  for (size_t j = 0; j < send.size(); ++j) {
    s[j] = send[j] * static_cast<size_t>(C);
    r[j] = recv[j] * static_cast<size_t>(C);
    ns += s[j], nr += r[j];
  }
  // Timed: the collective alone (the conversions are compute, as the
  // tensor-parallel group counts them).
  auto timed = [&](const void* src, void* dst, DType t) {
    const auto t0 = std::chrono::steady_clock::now();
    group_->all_to_all(src, s, dst, r, t)->wait();
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (payload_ == DType::kF32) {
    timed(in, out, DType::kF32);
  } else {
    const size_t es = dtype_size(payload_);
    Buffer in16 = be_->alloc(ns * es, MemCategory::kComm, false);
    Buffer out16 = be_->alloc(nr * es, MemCategory::kComm, false);
    be_->round_16(in, in16.as<uint16_t>(), static_cast<int64_t>(ns), payload_);
    timed(in16.data(), out16.data(), payload_);
    be_->widen_16(out16.as<uint16_t>(), out, static_cast<int64_t>(nr), payload_);
  }
  ++stats_.calls;
}

void AllToAllDispatcher::dispatch(const ExpertPlan& p, const float* rows, int64_t C,
                                  float* expert_rows) {
  // Received rank by rank (each rank's rows expert by expert), then put
  // expert by expert (each expert's rows rank by rank).
  Buffer staging =
      be_->alloc(static_cast<size_t>(p.rows() * C) * sizeof(float), MemCategory::kComm);
  float* in = staging.as<float>();
  exchange(rows, sent(p), in, received(p), C);
  std::vector<int64_t> at(p.offsets.begin(), p.offsets.end() - 1);  // next row per expert
  for (int s = 0; s < p.ranks; ++s)
    for (int e = 0; e < p.local; ++e) {
      const int64_t n = count(p, rank(), s, e);
      if (n == 0) continue;
      std::memcpy(expert_rows + at[static_cast<size_t>(e)] * C, in,
                  static_cast<size_t>(n * C) * sizeof(float));
      at[static_cast<size_t>(e)] += n;
      in += n * C;
    }
}

void AllToAllDispatcher::combine(const ExpertPlan& p, const float* expert_rows, int64_t C,
                                 float* rows) {
  // Back to rank by rank, then home, where they land in dispatch order.
  Buffer staging =
      be_->alloc(static_cast<size_t>(p.rows() * C) * sizeof(float), MemCategory::kComm);
  float* out = staging.as<float>();
  std::vector<int64_t> at(p.offsets.begin(), p.offsets.end() - 1);
  for (int s = 0; s < p.ranks; ++s)
    for (int e = 0; e < p.local; ++e) {
      const int64_t n = count(p, rank(), s, e);
      if (n == 0) continue;
      std::memcpy(out, expert_rows + at[static_cast<size_t>(e)] * C,
                  static_cast<size_t>(n * C) * sizeof(float));
      at[static_cast<size_t>(e)] += n;
      out += n * C;
    }
  exchange(staging.as<float>(), received(p), rows, sent(p), C);
}

AllToAllStats AllToAllDispatcher::take_stats() {
  AllToAllStats s = stats_;
  stats_ = AllToAllStats{};
  return s;
}

}  // namespace loom::ep
