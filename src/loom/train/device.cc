#include "loom/train/device.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <vector>

#include "loom/core/error.h"
#ifdef LOOM_HAVE_CUDA
#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/comm/nccl/nccl_process_group.h"
#include "loom/kernels/cuda/cuda_backend.h"
#endif

namespace loom {

RunBackend make_cuda_run_backend(const Config& c, const ParallelContext& ctx) {
#ifdef LOOM_HAVE_CUDA
  std::string why;
  const int gpus = cuda_device_count(&why);
  LOOM_CHECK_KIND(kConfig, gpus > 0, "device: cuda, but this machine has {}", why);
  // One GPU per rank: the ranks on this host against its GPUs.
  const Topology& topo = ctx.topology;
  if (topo.world() > 1) {
    const int host = topo.host_of[static_cast<size_t>(ctx.launch_rank)];
    const int here = static_cast<int>(topo.ranks_on(host).size());
    LOOM_CHECK_KIND(kConfig, here <= gpus,
                    "device: cuda: {} ranks on host {} share its {} GPU{}; loom runs one GPU per "
                    "rank (start at most {} rank{} per host)",
                    here, topo.names[static_cast<size_t>(host)], gpus, gpus == 1 ? "" : "s", gpus,
                    gpus == 1 ? "" : "s");
  }
  RunBackend r;
  r.gemm_inputs = c.kernels.gemm16 ? c.precision : DType::kF32;
  r.backend = std::make_unique<CudaBackend<float>>(CudaGemmConfig{r.gemm_inputs, c.kernels.tf32});
  r.gemm_backend = "cublaslt";
  r.describe = r.backend->name();
  return r;
#else
  (void)ctx;
  LOOM_FAIL(kConfig, "device: {} needs loom built with -DLOOM_CUDA=ON (docs/cuda.md)", c.device);
#endif
}

bool uses_nccl(const Config& c) {
  return c.comm.backend == "nccl" || (c.comm.backend == "auto" && c.device == "cuda");
}

ParallelContext with_nccl_groups(ParallelContext ctx, const Config& c) {
  if (!uses_nccl(c) || !ctx.world) return ctx;
#ifdef LOOM_HAVE_CUDA
  const int device = cuda_select_device();
  // Each distinct group once, in the same order on every rank (a group
  // serving two roles, such as dp and the world, is one communicator).
  std::map<ProcessGroup*, std::shared_ptr<ProcessGroup>> made;
  auto convert = [&](std::shared_ptr<ProcessGroup>& g, const char* role) {
    if (!g) return;
    auto it = made.find(g.get());
    if (it == made.end()) {
      std::shared_ptr<ProcessGroup> n =
          NcclProcessGroup::create(*g, g->name() == "world" ? std::string(role) : g->name(), device,
                                   c.comm.timeout_s, g->record());
      it = made.emplace(g.get(), std::move(n)).first;
    }
    g = it->second;
  };
  // The pipeline and context-parallel groups stay MPI: their messages are
  // separate sends and receives, which on NCCL's one stream per group wait
  // behind each other (a 1F1B stage's receive blocks the send its peer
  // needs). NCCL for them needs paired send-receive calls.
  convert(ctx.dp, "dp");
  convert(ctx.tp, "tp");
  convert(ctx.ep, "ep");
  convert(ctx.ep_dp, "ep_dp");
  convert(ctx.embedding, "embedding");
  convert(ctx.model_parallel, "model_parallel");
  return ctx;
#else
  LOOM_FAIL(kConfig, "comm.backend nccl needs loom built with -DLOOM_CUDA=ON (docs/cuda.md)");
#endif
}

double measure_gemm_gflops(const Backend<float>& b) {
  constexpr int64_t n = 4096;
  const size_t bytes = sizeof(float) * static_cast<size_t>(n * n);
  Buffer A = b.alloc(bytes, MemCategory::kWorkspace, true);
  Buffer B = b.alloc(bytes, MemCategory::kWorkspace, true);
  Buffer C = b.alloc(bytes, MemCategory::kWorkspace, true);
  b.fill(A.as<float>(), n * n, 0.01f);
  b.fill(B.as<float>(), n * n, 0.02f);
  auto once = [&] {
    b.gemm(false, false, n, n, n, 1.0f, A.as<float>(), n, B.as<float>(), n, 0.0f, C.as<float>(), n);
  };
  once();  // warm-up (algorithm choice, clocks)
  std::vector<double> s;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    once();  // the backend's operations complete before they return
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return 2.0 * double(n) * double(n) * double(n) / s[2] / 1e9;
}

}  // namespace loom
