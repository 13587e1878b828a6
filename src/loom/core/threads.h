// Threads per rank: the machine's cores divided by the ranks on this node,
// unless OMP_NUM_THREADS says otherwise. OpenMP and OpenBLAS use the same count.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace loom {

struct ThreadConfig {
  int threads = 1;         // threads this rank uses
  int cores = 1;           // cores on the machine
  int ranks_on_node = 1;   // this job's ranks on this host, 1 without a launcher
  int affinity_cores = 1;  // cores this process may run on (sched_getaffinity)
  bool from_env = false;   // OMP_NUM_THREADS was set
  std::string warning;     // non-empty when the affinity is narrower than the threads
};

// Decides the thread count, applies it to OpenMP and OpenBLAS, returns what
// was done. ranks_on_node: this job's ranks on this host as MPI counts them;
// 0 reads the launcher's environment instead (programs without MPI).
ThreadConfig configure_threads(int ranks_on_node = 0);

// The peak GFLOP/s of a job of `ranks` ranks like this one (MFU's
// denominator), from the per-rank peak measured with t.threads threads:
// per core, times the cores the ranks of a host can keep busy, per host.
// Ranks sharing a host's cores (4 ranks of 1 thread on 2 cores) share its
// peak; a rank with more threads than cores gets no more than the cores.
double job_peak_gflops(double per_rank_peak, const ThreadConfig& t, int ranks);

// Host work that is not a tensor operation (parameter initialisation into a
// host buffer, before a backend takes it): fn(begin, end) over pieces of [0,
// n) on the rank's threads. Tensor operations run on a backend
// (kernels/backend.h), which owns the threads of compute.
void host_parallel_for(int64_t n, const std::function<void(int64_t begin, int64_t end)>& fn);

// Makes the compute this thread starts run on it alone (an OpenMP region it
// opens gets one thread): for service threads, such as a process group's
// communication worker, that call a backend beside the rank's compute.
void run_this_thread_serially();

// One line for the log: "threads: 2 (2 cores, 1 rank on node, affinity 2 cores)".
std::string describe(const ThreadConfig& t);

}  // namespace loom
