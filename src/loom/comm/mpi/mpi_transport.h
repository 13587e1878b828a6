// What the MPI backend's collectives share (mpi_process_group.cc and
// mpi_collectives.cc): MPI's element types for loom's, reductions in f32.
// The transport's conversions, sums and averages run on the host backend
// (default_backend<float>(), on the worker thread with one thread of its
// own: run_this_thread_serially).
#pragma once

#include <mpi.h>

#include <climits>
#include <cstddef>

#include "loom/comm/process_group.h"
#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/kernels/backend.h"

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

// Runs a reduction in f32: bf16 and f16 inputs are widened on `be` into a
// comm-category buffer (and the caller narrows the result back on it), so
// accumulation is always f32.
struct F32View {
  Buffer owned;
  float* data = nullptr;
  F32View(const void* src, DType t, size_t n, const Backend<float>& be) {
    if (t == DType::kF32) {
      data = const_cast<float*>(static_cast<const float*>(src));
      return;
    }
    owned = be.alloc(n * sizeof(float), MemCategory::kComm, false);  // all written next
    data = owned.as<float>();
    be.widen_16(static_cast<const uint16_t*>(src), data, static_cast<int64_t>(n), t);
  }
  F32View(size_t n, const Backend<float>& be)
      : owned(be.alloc(n * sizeof(float), MemCategory::kComm)), data(owned.as<float>()) {}
};

}  // namespace loom::mpi
