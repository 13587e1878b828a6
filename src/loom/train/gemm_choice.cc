#include "loom/train/gemm_choice.h"

#include "loom/core/error.h"

namespace loom {

GemmChoice configure_gemm(const std::string& setting) {
  using cpu::GemmBackend;
  GemmChoice c;
  if (setting == "openblas" || setting == "onednn") {
    c.backend = setting == "onednn" ? GemmBackend::kOneDnn : GemmBackend::kOpenBlas;
    cpu::check_gemm_backend(c.backend);
    c.describe = format("{} ({}), as kernels.gemm asks", setting, cpu::gemm_backend_isa(c.backend));
  } else {
    LOOM_CHECK_KIND(kConfig, setting == "auto",
                    "kernels.gemm: unknown value \"{}\" (expected one of auto, onednn, openblas)",
                    setting);
    // oneDNN whenever this build has it: it knows every x86 processor, where
    // OpenBLAS 0.3.21 falls back to a generic kernel on the ones it does not
    // (gpt-m 476 vs 1181 tokens/s), and elsewhere it is as fast (within the
    // noise on gpt-m at AVX-512 and AVX2; docs/performance.md). A rule, not a
    // timing, so every run and every rank computes with the same backend.
    c.backend = cpu::gemm_backend_available(GemmBackend::kOneDnn) ? GemmBackend::kOneDnn
                                                                  : GemmBackend::kOpenBlas;
    c.describe = format("{} ({}; auto: {})", cpu::gemm_backend_name(c.backend),
                        cpu::gemm_backend_isa(c.backend),
                        c.backend == GemmBackend::kOneDnn ? "oneDNN whenever this build has it"
                                                          : "this build has no oneDNN");
  }
  if (c.backend == GemmBackend::kOpenBlas) c.warning = cpu::openblas_misdetection();
  return c;
}

}  // namespace loom
