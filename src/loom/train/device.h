// `device` and `comm.backend`: the backend a run computes on and the groups
// its ranks communicate over (docs/cuda.md).
//
//   device: cpu    the CPU backend (kernels.gemm, kernels.gemm_inputs), MPI groups.
//   device: cuda   one GPU per rank (the local rank's, CUDA_VISIBLE_DEVICES
//                  respected), the CUDA backend (cuBLASLt, kernels.gemm_inputs,
//                  kernels.tf32), and with comm.backend nccl (the default
//                  there) NCCL groups bootstrapped over MPI.
#pragma once

#include <memory>
#include <string>

#include "loom/comm/parallel_context.h"
#include "loom/kernels/backend.h"
#include "loom/train/config.h"

namespace loom {

// The run's compute backend and how the log and metrics name its GEMMs.
struct RunBackend {
  std::unique_ptr<Backend<float>> backend;
  DType gemm_inputs = DType::kF32;  // the GEMMs' input type
  std::string gemm_backend;         // metrics' gemm_backend: "onednn", "openblas", "cublaslt"
  std::string describe;             // for the log
};

// device: cuda's backend on this rank's GPU. Throws Error(kConfig) naming
// the cause on a build without CUDA, a machine without a GPU, or a host
// with more ranks than GPUs.
RunBackend make_cuda_run_backend(const Config& c, const ParallelContext& ctx);

// comm.backend nccl, or auto with device cuda.
bool uses_nccl(const Config& c);

// uses_nccl: ctx with every grid group (dp, cp, tp, pp, ep, ep_dp,
// embedding, model_parallel) replaced by an NCCL group bootstrapped over
// it (a group shared by two roles stays shared); the world stays MPI for
// control messages. Collective over the world. Throws Error(kComm) when NCCL
// cannot initialise, naming the group and the NCCL error.
ParallelContext with_nccl_groups(ParallelContext ctx, const Config& c);

// The GEMM rate of a backend, measured with its own gemm (4096^3, the
// median of five after a warm-up), GFLOP/s: device cuda's MFU denominator
// unless log.peak_gflops says otherwise.
double measure_gemm_gflops(const Backend<float>& b);

}  // namespace loom
