#include "loom/core/threads.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "loom/core/error.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace loom {

namespace {
int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (end != v && x > 0) ? static_cast<int>(x) : fallback;
}
}  // namespace

ThreadConfig configure_threads(int ranks_on_node) {
  ThreadConfig t;
  t.cores = std::max(1, static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
  // Open MPI, MPICH and Slurm each name the local rank count differently.
  t.ranks_on_node = ranks_on_node > 0
                        ? ranks_on_node
                        : env_int("OMPI_COMM_WORLD_LOCAL_SIZE",
                                  env_int("MPI_LOCALNRANKS", env_int("SLURM_NTASKS_PER_NODE", 1)));
  cpu_set_t set;
  CPU_ZERO(&set);
  t.affinity_cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : t.cores;
  t.threads = std::max(1, t.cores / t.ranks_on_node);
  if (int env = env_int("OMP_NUM_THREADS", 0); env > 0) {
    t.threads = env;
    t.from_env = true;
  }
  if (t.affinity_cores < t.threads) {
    t.warning = format(
        "this rank may run on {} core(s) but uses {} threads; they will share cores and run "
        "slower (with mpirun, pass --bind-to none or --map-by slot:PE={})",
        t.affinity_cores, t.threads, t.threads);
  }
  omp_set_num_threads(t.threads);
  openblas_set_num_threads(t.threads);
  return t;
}

double job_peak_gflops(double per_rank_peak, const ThreadConfig& t, int ranks) {
  const int cores = std::max(1, t.cores), threads = std::max(1, t.threads);
  const int on_node = std::max(1, t.ranks_on_node);
  const double per_core = per_rank_peak / std::min(threads, cores);
  const double host_cores = std::min(double(cores), double(on_node) * threads);
  return per_core * host_cores * double(ranks) / double(on_node);
}

std::string describe(const ThreadConfig& t) {
  return format("threads: {}{} ({} cores, {} rank(s) on node, affinity {} cores)", t.threads,
                t.from_env ? " from OMP_NUM_THREADS" : "", t.cores, t.ranks_on_node,
                t.affinity_cores);
}

void host_parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kPiece = 4096;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b += kPiece) fn(b, std::min(n, b + kPiece));
}

void run_this_thread_serially() {
  omp_set_num_threads(1);  // this thread's own setting; the others keep theirs
}

}  // namespace loom
