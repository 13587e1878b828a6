// What a step multiplies, and how fast those GEMMs alone could run: while a
// census is open, every GEMM the CPU kernels call (gemm_f32 and gemm_16, the
// attention core's block products included; a GEMM's own inner calls are not
// counted again) is tallied by its form: backend, input type, transposes,
// shape, leading dimensions, whether it accumulates into C, which operands
// come in 16 bits, a bias, a packed weight, and whether it was called from
// inside an OpenMP parallel region and that region's team (such a call runs
// on one thread, beside the team's other calls). Replaying each form alone, on operands of
// its shapes, gives the step's GEMM time with nothing else in it: the
// GEMM-bound ceiling `loom bench train --ceiling` reports.
#pragma once

#include <compare>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/kernels/cpu/gemm_backend.h"

namespace loom::cpu {

struct GemmForm {
  GemmBackend backend = GemmBackend::kOpenBlas;
  DType inputs = DType::kF32;  // kF32: gemm_f32; kBF16/kF16: gemm_16
  bool ta = false, tb = false;
  int64_t M = 0, N = 0, K = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  bool accumulate = false;  // beta != 0
  bool a16 = false, b16 = false, bias = false, packed = false;
  bool nested = false;  // called from inside a parallel region (active or not)
  int team = 1;         // the threads of that region, calling GEMMs side by side
  auto operator<=>(const GemmForm&) const = default;
  double flops() const { return 2.0 * double(M) * double(N) * double(K); }
  std::string describe() const;  // "f32 NT 64 x 256 x 64 +=C (x2 threads)"
};

struct GemmTally {
  GemmForm form;
  int64_t calls = 0;
};

// Opens a census (process-wide; one at a time) and closes it, returning the
// tallies in form order. Closing without opening returns nothing.
void gemm_census_open();
std::vector<GemmTally> gemm_census_close();

// Called by the GEMM entry points. Counts the call when a census is open and
// the caller is not itself inside a counted GEMM; returns whether it did (the
// caller then ends its count with gemm_census_leave()).
bool gemm_census_enter(const GemmForm& form);
void gemm_census_leave();
// gemm_census_enter for a scope.
class GemmCounted {
 public:
  explicit GemmCounted(const GemmForm& form) : on_(gemm_census_enter(form)) {}
  ~GemmCounted() {
    if (on_) gemm_census_leave();
  }
  GemmCounted(const GemmCounted&) = delete;
  GemmCounted& operator=(const GemmCounted&) = delete;

 private:
  bool on_;
};

// The wall time one call of `form` takes alone: the median over batches of
// calls on operands of its shapes (filled with small values), after a warm-up;
// a nested form runs inside a parallel region of its team, each thread making
// its own calls at once, and counts each call as 1/team of the wall time, as
// the step's calls share it.
double gemm_replay_seconds(const GemmForm& form);

}  // namespace loom::cpu
