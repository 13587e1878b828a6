#include "loom/train/gemm_choice.h"

#include "loom/core/dtype.h"
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

GemmInputsChoice resolve_gemm_inputs(const std::string& setting, DType precision,
                                     const std::string& device, const cpu::Bf16MatmulFacts& cpu) {
  if (setting != "auto" && setting != "f32" && setting != "16bit")
    LOOM_FAIL(kConfig,
              "kernels.gemm_inputs: unknown value \"{}\" (expected one of auto, f32, 16bit)",
              setting);
  const std::string t(dtype_name(precision));
  if (setting == "f32") return {false, "f32, as kernels.gemm_inputs asks"};
  if (precision == DType::kF32) {
    if (setting != "auto")
      LOOM_FAIL(kConfig,
                "kernels.gemm_inputs: 16bit rounds GEMM inputs to the run's 16-bit type; it "
                "needs bf16.enabled or fp16.enabled");
    return {false, "f32: an f32 run"};
  }
  if (device == "cuda")
    return {true, setting == "auto" ? format("{}: auto, the GPU's tensor cores", t)
                                    : format("{}, as kernels.gemm_inputs asks", t)};
  if (setting == "16bit") {
    if (precision == DType::kBF16 && !cpu.runs)
      LOOM_FAIL(kConfig,
                "kernels.gemm_inputs: 16bit with bf16.enabled: this CPU has no bf16 GEMM "
                "(oneDNN's bf16 matmul does not run at ISA {}{}); use auto or f32, which "
                "multiply in f32 here",
                cpu.isa, cpu.onednn ? "" : ", and this build has no oneDNN");
    return {true, format("{}, as kernels.gemm_inputs asks ({})", t,
                         precision == DType::kBF16 && cpu.runs
                             ? "oneDNN's bf16 matmul"
                             : "K-tiles rounded, then the backend's sgemm")};
  }
  if (precision == DType::kBF16) {
    std::string why;
    const bool pays = cpu::bf16_matmul_pays(cpu, &why);
    return {pays, format("{}: auto, {}", pays ? "bf16" : "f32", why)};
  }
  return {false,
          "f32: auto, no CPU multiplies fp16 natively (16bit would round K-tiles "
          "for the sgemm, slower than f32)"};
}

}  // namespace loom
