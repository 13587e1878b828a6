// GoogleTest main for tests launched as `mpirun -np N loom_mpi_tests`: every
// rank runs every test; the process exits non-zero if any rank failed.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "loom/core/memory.h"
#include "mpi_main.h"

namespace loom::test {
namespace {
MpiRuntime* g_runtime = nullptr;

// On ranks other than 0: every failed assertion (an exception escaping a
// test included), with the rank and the test (the progress is rank 0's
// alone). The test's name is kept at its start: GoogleTest holds its lock
// while it reports a result.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo& t) override {
    test_ = std::string(t.test_suite_name()) + "." + t.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::printf("[ rank %d ] %s: %s:%d: Failure\n%s\n", rank_, test_.c_str(),
                r.file_name() ? r.file_name() : "(unknown file)", r.line_number(), r.message());
    std::fflush(stdout);
  }

 private:
  int rank_;
  std::string test_;
};
}  // namespace
MpiRuntime& runtime() {
  return *g_runtime;
}
}  // namespace loom::test

int main(int argc, char** argv) {
  loom::keep_freed_host_memory();  // as the command-line tool does
  auto rt = std::make_unique<loom::MpiRuntime>(&argc, &argv);
  loom::test::g_runtime = rt.get();
  ::testing::InitGoogleTest(&argc, argv);
  if (rt->world_rank() != 0) {
    // Only rank 0 prints the progress; failures on any rank still print.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new loom::test::FailurePrinter(rt->world_rank()));
  }
  int failed = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  rt.reset();
  return any;
}
