// A job whose rank 1 is alive but late: it sleeps past comm.timeout_s before
// joining an all-reduce. Rank 0's watchdog must report the operation, its
// sequence number and size, and rank 1 as not arrived, then end the job.
// With the argument `p2p`, rank 1 waits for a message rank 0 never sends:
// its watchdog must name the message and the peer.
// Run by tests/mpi/failure.sh; exits non-zero by design.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "loom/comm/mpi/mpi_process_group.h"

int main(int argc, char** argv) {
  loom::MpiRuntime rt(&argc, &argv);
  loom::CommOptions opt;
  opt.timeout_s = 2;
  auto g = rt.world(opt);
  std::vector<float> x(1000, 1.0f);
  if (argc > 1 && std::string(argv[1]) == "p2p") {
    if (g->rank() == 1)
      g->recv(x.data(), x.size(), loom::DType::kF32, 0, 5,
              "pipeline receive of the activation of micro-batch 3 (chunk 0) from stage 0")
          ->wait();
    std::this_thread::sleep_for(std::chrono::seconds(30));
    return 0;
  }
  g->all_reduce(x.data(), x.data(), x.size(), loom::DType::kF32, loom::ReduceOp::kSum)->wait();
  if (g->rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(30));
  g->all_reduce(x.data(), x.data(), x.size(), loom::DType::kF32, loom::ReduceOp::kSum)->wait();
  std::printf("rank %d: not reached\n", g->rank());
  return 0;
}
