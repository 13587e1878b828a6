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
                                     const std::string& device) {
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
  const std::string isa = cpu::gemm_backend_isa(cpu::GemmBackend::kOneDnn);
  if (device == "cuda")
    return {true, setting == "auto" ? format("{}: auto, the GPU's tensor cores", t)
                                    : format("{}, as kernels.gemm_inputs asks", t)};
  if (setting == "16bit") {
    if (precision == DType::kBF16 && !cpu::gemm_16_uses_bf16_matmul(precision))
      LOOM_FAIL(kConfig,
                "kernels.gemm_inputs: 16bit with bf16.enabled: this CPU has no bf16 GEMM "
                "(oneDNN's bf16 matmul does not run at ISA {}{}); use auto or f32, which "
                "multiply in f32 here",
                isa,
                cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn)
                    ? ""
                    : ", and this build has no oneDNN");
    return {true, format("{}, as kernels.gemm_inputs asks ({})", t, cpu::gemm_16_path(precision))};
  }
  if (precision == DType::kBF16 && cpu::bf16_matmul_on_amx())
    return {true, format("bf16: auto, oneDNN's bf16 matmul on AMX tiles (ISA {})", isa)};
  if (precision == DType::kBF16 && !cpu::gemm_backend_available(cpu::GemmBackend::kOneDnn))
    return {false, "f32: auto, this build has no oneDNN (so no bf16 matmul)"};
  if (precision == DType::kBF16)
    return {false, format("f32: auto, ISA {} has no AMX, where rounding the operands to bf16 "
                          "costs more than its bf16 GEMMs gain (docs/precision.md#16-bit-gemms)",
                          isa)};
  return {false,
          "f32: auto, no CPU multiplies fp16 natively (16bit would round K-tiles "
          "for the sgemm, slower than f32)"};
}

}  // namespace loom
