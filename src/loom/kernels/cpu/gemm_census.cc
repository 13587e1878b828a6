#include "loom/kernels/cpu/gemm_census.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <mutex>

#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/kernels/cpu/precision.h"

namespace loom::cpu {

namespace {

std::atomic<bool> g_open{false};
std::mutex g_mutex;
std::map<GemmForm, int64_t> g_tally;
thread_local bool t_inside = false;  // this thread is inside a counted GEMM

// One thread's operands for a form: A, B and C of its shapes and leading
// dimensions, their 16-bit copies where the form reads 16 bits, a bias, and
// somewhere to keep a packed weight.
struct Operands {
  Buffer a, b, c, a16, b16, bias;
  std::unique_ptr<WeightPacks> packs;

  explicit Operands(const GemmForm& f) {
    const int64_t a_elems = (f.ta ? f.K : f.M) * f.lda, b_elems = (f.tb ? f.N : f.K) * f.ldb;
    a = fill(a_elems, 17, 0.01f), b = fill(b_elems, 13, 0.02f);
    c = Buffer(static_cast<size_t>(f.M * f.ldc) * sizeof(float), MemCategory::kWorkspace);
    if (f.a16) a16 = rounded(a, a_elems, f.inputs);
    if (f.b16) b16 = rounded(b, b_elems, f.inputs);
    if (f.bias) bias = fill(f.N, 7, 0.1f);
    if (f.packed) packs = make_weight_packs();
  }
  static Buffer fill(int64_t n, int period, float step) {
    Buffer x(static_cast<size_t>(n) * sizeof(float), MemCategory::kWorkspace, false);
    for (int64_t i = 0; i < n; ++i) x.as<float>()[i] = float(i % period) * step;
    return x;
  }
  static Buffer rounded(const Buffer& x, int64_t n, DType t) {
    Buffer r(static_cast<size_t>(n) * sizeof(uint16_t), MemCategory::kWorkspace, false);
    round_to_16(x.as<float>(), r.as<uint16_t>(), n, t);
    return r;
  }
  void call(const GemmForm& f) {
    const float beta = f.accumulate ? 1.0f : 0.0f;
    if (f.inputs == DType::kF32) {
      gemm_f32(f.backend, f.ta, f.tb, f.M, f.N, f.K, 1.0f, a.as<float>(), f.lda, b.as<float>(),
               f.ldb, beta, c.as<float>(), f.ldc);
      return;
    }
    gemm_16(f.backend, f.inputs, f.ta, f.tb, f.M, f.N, f.K, 1.0f, a.as<float>(), f.lda,
            b.as<float>(), f.ldb, beta, c.as<float>(), f.ldc, f.b16 ? b16.as<uint16_t>() : nullptr,
            f.a16 ? a16.as<uint16_t>() : nullptr, f.bias ? bias.as<float>() : nullptr, packs.get());
  }
};

}  // namespace

std::string GemmForm::describe() const {
  std::string s = format("{} {}{} {} x {} x {}", std::string(dtype_name(inputs)), ta ? 'T' : 'N',
                         tb ? 'T' : 'N', M, N, K);
  if (accumulate) s += " +=C";
  if (a16) s += " a16";
  if (b16) s += packed ? " b16 packed" : " b16";
  if (bias) s += " +bias";
  if (nested) s += team > 1 ? format(" (x{} threads)", team) : std::string(" (in a region)");
  return s;
}

void gemm_census_open() {
  std::lock_guard<std::mutex> lock(g_mutex);
  LOOM_CHECK(!g_open.load(), "gemm_census_open: a census is already open");
  g_tally.clear();
  g_open.store(true);
}

std::vector<GemmTally> gemm_census_close() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_open.store(false);
  std::vector<GemmTally> out;
  for (const auto& [form, calls] : g_tally) out.push_back({form, calls});
  g_tally.clear();
  return out;
}

bool gemm_census_enter(const GemmForm& form) {
  if (!g_open.load(std::memory_order_relaxed) || t_inside) return false;
  GemmForm f = form;
  f.nested = omp_get_level() > 0;
  f.team = f.nested ? omp_get_num_threads() : 1;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_open.load()) return false;
    ++g_tally[f];
  }
  t_inside = true;
  return true;
}

void gemm_census_leave() {
  t_inside = false;
}

double gemm_replay_seconds(const GemmForm& f) {
  LOOM_CHECK(!g_open.load(), "gemm_replay_seconds: close the census first (it would count these)");
  LOOM_CHECK(f.M > 0 && f.N > 0 && f.team >= 1, "gemm_replay_seconds: an empty form {}",
             f.describe());
  // A batch of k calls: a form called outside any parallel region runs
  // here, as it did; a nested one on each thread of a region of its team
  // (operands made on the thread that uses them), timed between barriers,
  // each call counting 1/threads of it. An error inside the region is
  // carried out of it and thrown here.
  std::unique_ptr<Operands> alone;
  std::vector<std::unique_ptr<Operands>> ops(static_cast<size_t>(f.team));
  auto batch = [&](int64_t k) {
    if (!f.nested) {
      if (!alone) alone = std::make_unique<Operands>(f);
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t r = 0; r < k; ++r) alone->call(f);
      return seconds_since(t0) / double(k);
    }
    double s = 0;
    int threads = 1;
    std::exception_ptr failed;  // the first error, under failed_mutex
    std::mutex failed_mutex;
    std::atomic<bool> any_failed{false};
    auto keep_error = [&] {
      std::lock_guard<std::mutex> lock(failed_mutex);
      if (!failed) failed = std::current_exception();
      any_failed.store(true);
    };
#pragma omp parallel num_threads(f.team)
    {
      const auto i = static_cast<size_t>(omp_get_thread_num());
      try {
        if (!ops[i]) ops[i] = std::make_unique<Operands>(f);
      } catch (...) {
        keep_error();
      }
#pragma omp barrier
      const auto t0 = std::chrono::steady_clock::now();
      if (!any_failed.load()) try {
          for (int64_t r = 0; r < k; ++r) ops[i]->call(f);
        } catch (...) {
          keep_error();
        }
#pragma omp barrier
      if (i == 0) s = seconds_since(t0), threads = omp_get_num_threads();
    }
    if (failed) std::rethrow_exception(failed);
    return s / double(k * threads);
  };
  batch(1);  // warm-up: operands, primitives, packed weights
  const double one = std::max(batch(1), 1e-7);
  // Batches of about 2 ms of calls, five of them (three past 50 ms a call).
  const int64_t k = std::clamp<int64_t>(static_cast<int64_t>(2e-3 / (one * f.team)) + 1, 1, 100000);
  const int batches = one > 0.05 ? 3 : 5;
  std::vector<double> per_call;
  for (int b = 0; b < batches; ++b) per_call.push_back(batch(k));
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

}  // namespace loom::cpu
