// GoogleTest main for tests launched as `mpirun -np N loom_mpi_tests`: every
// rank runs every test; the process exits non-zero if any rank failed.
#include <gtest/gtest.h>

#include <memory>

#include "mpi_main.h"

namespace loom::test {
namespace {
MpiRuntime* g_runtime = nullptr;
}
MpiRuntime& runtime() {
  return *g_runtime;
}
}  // namespace loom::test

int main(int argc, char** argv) {
  auto rt = std::make_unique<loom::MpiRuntime>(&argc, &argv);
  loom::test::g_runtime = rt.get();
  ::testing::InitGoogleTest(&argc, argv);
  if (rt->world_rank() != 0) {
    // Only rank 0 prints the progress; failures on any rank still print.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  rt.reset();
  return any;
}
