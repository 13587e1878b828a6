// kernels.gemm at start: which GEMM backend the run uses, and why.
#pragma once

#include <string>

#include "loom/kernels/cpu/gemm_backend.h"

namespace loom {

struct GemmChoice {
  cpu::GemmBackend backend = cpu::GemmBackend::kOpenBlas;
  std::string describe;  // "onednn (avx512_core_bf16; auto: ...)"
  std::string warning;   // OpenBLAS misdetection while OpenBLAS is in use, else ""
};

// Resolves `setting` ("auto", "onednn", "openblas"); "auto" is oneDNN when
// this build has it, else OpenBLAS (a rule, so every run and rank agree).
// The run's CPU backend then holds the choice (nothing is set process-wide).
GemmChoice configure_gemm(const std::string& setting);

}  // namespace loom
