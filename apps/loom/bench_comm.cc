// loom bench comm: collective bandwidth per algorithm, in the style of
// nccl-tests, under mpirun; and how much of an all-reduce hides behind compute.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/kernels/backend.h"
#include "loom/train/config.h"

namespace loom::app {

namespace {

struct CommBenchArgs {
  std::string op = "allreduce";
  std::vector<std::string> algos = {"mpi", "ring", "rhd", "hierarchical"};
  std::string min = "4K", max = "64M";
  int iters = 20, warmup = 3;
  double budget_s = 0;  // > 0: fewer iterations where one takes long
  std::vector<std::string> overrides;
  bool json = false;
  bool overlap = false;
};

size_t parse_size(const std::string& s, const char* what) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::string unit = end;
  double mult = unit.empty()  ? 1
                : unit == "K" ? 1 << 10
                : unit == "M" ? 1 << 20
                : unit == "G" ? 1 << 30
                              : -1;
  LOOM_CHECK_KIND(kConfig, end != s.c_str() && mult > 0 && v > 0,
                  "{} {}: expected a byte count like 4K, 16M or 1G", what, s);
  return static_cast<size_t>(v * mult);
}

using Clock = std::chrono::steady_clock;
// The bus bandwidth factor of nccl-tests: the share of the data each rank
// must send for the operation, so results compare across group sizes.
double bus_factor(const std::string& op, int n) {
  if (n <= 1) return 0;
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  return double(n - 1) / n;
}

double time_op(MpiProcessGroup& g, const CommBenchArgs& a, const std::string& algo, size_t bytes,
               std::vector<float>& in, std::vector<float>& out) {
  const size_t n = bytes / sizeof(float);
  const int p = g.size();
  auto run = [&] {
    if (a.op == "allreduce") {
      g.all_reduce_with(algo, in.data(), in.data(), n, DType::kF32, ReduceOp::kSum)->wait();
    } else if (a.op == "reducescatter") {
      g.reduce_scatter(in.data(), out.data(), n / p, DType::kF32, ReduceOp::kSum)->wait();
    } else if (a.op == "allgather") {
      g.all_gather(in.data(), out.data(), n / p, DType::kF32)->wait();
    } else {
      std::vector<size_t> counts(static_cast<size_t>(p), n / p);
      g.all_to_all(in.data(), counts, out.data(), counts, DType::kF32)->wait();
    }
  };
  int iters = a.iters;
  for (int i = 0; i < a.warmup; ++i) {
    auto t0 = Clock::now();
    run();
    if (i > 0 || a.budget_s <= 0) continue;
    // Every rank must run the same count: the slowest rank's first run decides.
    double first = seconds_since(t0), worst = 0;
    MPI_Allreduce(&first, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    iters = static_cast<int>(std::clamp(a.budget_s / worst, 2.0, double(a.iters)));
  }
  g.barrier()->wait();
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) run();
  double local = seconds_since(t0) / iters, slowest = 0;
  MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

void run_overlap(MpiProcessGroup& g, size_t bytes, const std::string& algo) {
  const size_t n = bytes / sizeof(float);
  std::vector<float> x(n, 1.0f);
  const int64_t m = 768;
  Buffer A(m * m * 4, MemCategory::kWorkspace), B(m * m * 4, MemCategory::kWorkspace),
      C(m * m * 4, MemCategory::kWorkspace);
  const Backend<float>& be = default_backend<float>();
  auto compute = [&](int reps) {
    for (int r = 0; r < reps; ++r)
      be.gemm(false, false, m, m, m, 1.0f, A.as<float>(), m, B.as<float>(), m, 0.0f, C.as<float>(),
              m);
  };
  auto comm = [&] {
    return g.all_reduce_with(algo, x.data(), x.data(), n, DType::kF32, ReduceOp::kSum);
  };
  comm()->wait();
  compute(1);
  g.barrier()->wait();
  auto t0 = Clock::now();
  comm()->wait();
  double t_comm = seconds_since(t0);
  // Enough matmuls to outlast the all-reduce alone.
  t0 = Clock::now();
  compute(1);
  double one = seconds_since(t0);
  int reps = std::max(1, static_cast<int>(1.5 * t_comm / one) + 1);
  g.barrier()->wait();
  t0 = Clock::now();
  compute(reps);
  double t_compute = seconds_since(t0);
  g.barrier()->wait();
  t0 = Clock::now();
  WorkPtr w = comm();
  compute(reps);
  double t_compute_overlapped = seconds_since(t0);
  auto t1 = Clock::now();
  bool finished = w->test();
  w->wait();
  double waited = seconds_since(t1);
  double local[5] = {t_comm, t_compute, t_compute_overlapped, waited, finished ? 1.0 : 0.0};
  double worst[5];
  MPI_Allreduce(local, worst, 5, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (g.rank() == 0) {
    std::printf(
        "# overlap (%s, %zu bytes, %d ranks): all-reduce alone %.2f ms; %d matmuls "
        "alone %.2f ms; started together: matmuls %.2f ms, then waited %.3f ms for the "
        "all-reduce (%s when the matmuls ended; %.0f%% of it hidden)\n",
        algo.c_str(), bytes, g.size(), worst[0] * 1e3, reps, worst[1] * 1e3, worst[2] * 1e3,
        worst[3] * 1e3, worst[4] > 0 ? "finished" : "not finished",
        100.0 * std::max(0.0, 1.0 - worst[3] / worst[0]));
  }
}

void run_comm_bench(const CommBenchArgs& a) {
  LOOM_CHECK_KIND(
      kConfig,
      a.op == "allreduce" || a.op == "reducescatter" || a.op == "allgather" || a.op == "alltoall",
      "--op {}: expected allreduce, reducescatter, allgather or alltoall", a.op);
  const CommOptions options = comm_options_from(a.overrides);
  const size_t lo = parse_size(a.min, "--min"), hi = parse_size(a.max, "--max");
  LOOM_CHECK_KIND(kConfig, a.budget_s <= 0 || a.warmup >= 1,
                  "--budget-s needs --warmup 1 or more (the first warm-up run is timed)");
  MpiRuntime rt(nullptr, nullptr);
  try {
    auto g = rt.world(options);
    const int p = g->size();
    std::vector<std::string> algos =
        a.op == "allreduce" ? a.algos : std::vector<std::string>{"mpi"};
    if (g->rank() == 0 && !a.json) {
      std::printf("# loom bench comm: %s, %d ranks, %d iterations after %d warm-up%s\n",
                  a.op.c_str(), p, a.iters, a.warmup,
                  a.budget_s > 0 ? format(" (fewer past {} s a size)", a.budget_s).c_str() : "");
      std::printf("# %s\n", rt.topology().describe().c_str());
      std::printf("%12s %12s %14s %12s %12s %12s\n", "size(B)", "count(f32)", "algo", "time(us)",
                  "algbw(GB/s)", "busbw(GB/s)");
    }
    std::vector<float> in(hi / sizeof(float) + p), out(hi / sizeof(float) + p);
    for (size_t bytes = lo; bytes <= hi; bytes *= 2) {
      // Whole f32 elements, divisible by the group size.
      size_t n = std::max<size_t>(bytes / sizeof(float) / p * p, p);
      size_t b = n * sizeof(float);
      for (const std::string& algo : algos) {
        double t = time_op(*g, a, algo, b, in, out);
        double algbw = double(b) / t / 1e9, busbw = algbw * bus_factor(a.op, p);
        if (g->rank() != 0) continue;
        if (a.json) {
          nlohmann::json j = {
              {"op", a.op},  {"algo", algo},   {"ranks", p},     {"bytes", b},
              {"time_s", t}, {"algbw", algbw}, {"busbw", busbw}, {"hosts", rt.topology().hosts()}};
          if (algo == "auto") j["chosen"] = g->choose_algorithm(b);
          std::printf("%s\n", j.dump().c_str());
        } else {
          std::printf("%12zu %12zu %14s %12.1f %12.3f %12.3f\n", b, n, algo.c_str(), t * 1e6, algbw,
                      busbw);
        }
        std::fflush(stdout);
      }
    }
    if (a.overlap)
      run_overlap(*g, 16u << 20, options.allreduce == "auto" ? "ring" : options.allreduce);
  } catch (const std::exception& e) {
    // Other ranks may be inside a collective: end the whole job with the reason.
    rt.abort(e.what());
  }
}

}  // namespace

void add_bench_comm_command(CLI::App& bench) {
  auto a = std::make_shared<CommBenchArgs>();
  CLI::App* cmd = bench.add_subcommand("comm", "Collective bandwidth under mpirun");
  cmd->add_option("--op", a->op, "allreduce | reducescatter | allgather | alltoall");
  cmd->add_option("--algo", a->algos, "All-reduce algorithms: mpi,ring,rhd,hierarchical,auto")
      ->delimiter(',');
  cmd->add_option("--min", a->min, "Smallest message, bytes (4K, 1M, ...)");
  cmd->add_option("--max", a->max, "Largest message, bytes");
  cmd->add_option("--iters", a->iters, "Timed iterations per size")->check(CLI::PositiveNumber);
  cmd->add_option("--budget-s", a->budget_s,
                  "Seconds per size and algorithm: fewer iterations where one is slow")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--warmup", a->warmup, "Untimed iterations per size")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--set", a->overrides,
                  "comm.key=value (timeout_s, allreduce, ranks_per_node, debug)");
  cmd->add_flag("--json", a->json, "One JSON object per line");
  cmd->add_flag("--overlap", a->overlap,
                "Also measure a 16 MiB all-reduce started before a run of matmuls");
  cmd->callback([a] { run_comm_bench(*a); });
}

}  // namespace loom::app
