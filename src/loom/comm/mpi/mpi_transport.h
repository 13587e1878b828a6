// What the MPI backend's collectives share (mpi_process_group.cc and
// mpi_collectives.cc): MPI's element types for loom's, reductions in f32.
#pragma once

#include <mpi.h>

#include <climits>
#include <cstddef>

#include "loom/comm/process_group.h"
#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"

namespace loom::mpi {

inline int as_int(size_t n, const char* what) {
  LOOM_CHECK_KIND(kUnsupported, n <= static_cast<size_t>(INT_MAX),
                  "{} of {} elements exceeds MPI's int count", what, n);
  return static_cast<int>(n);
}

// Raw transport type: reductions of bf16/f16 go through f32 (F32View).
inline MPI_Datatype transport_type(DType t) {
  switch (t) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kU8:
      return MPI_BYTE;
    case DType::kF64:
      return MPI_DOUBLE;
    case DType::kI64:
      return MPI_INT64_T;
    default:
      return MPI_UINT16_T;
  }
}

inline MPI_Op mpi_op(ReduceOp op) {
  return op == ReduceOp::kMax ? MPI_MAX : MPI_SUM;
}

// Runs a reduction in f32: bf16 and f16 inputs are widened into a comm-category
// buffer and the result narrowed back, so accumulation is always f32.
struct F32View {
  Buffer owned;
  float* data = nullptr;
  F32View(const void* src, DType t, size_t n) {
    if (t == DType::kF32) {
      data = const_cast<float*>(static_cast<const float*>(src));
      return;
    }
    owned = Buffer(n * sizeof(float), MemCategory::kComm);
    data = owned.as<float>();
    convert(src, t, data, DType::kF32, n);
  }
  F32View(size_t n) : owned(n * sizeof(float), MemCategory::kComm), data(owned.as<float>()) {}
};

}  // namespace loom::mpi
