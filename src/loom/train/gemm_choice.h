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

// kernels.gemm_inputs resolved for a run whose 16-bit type is `precision`
// (kF32: an f32 run) on `device` ("cpu" or "cuda"): whether its GEMMs take
// 16-bit inputs, and why, in words for the log.
struct GemmInputsChoice {
  bool sixteen = false;
  std::string why;
};
// "auto" is a rule of the precision, the device and the CPU as oneDNN sees
// it (cpu::bf16_matmul_pays), so every rank and run on like machines
// computes the same: 16-bit on a GPU and for bf16 where oneDNN's bf16
// matmul outruns the sgemm enough to pay for rounding its operands (AMX
// tiles; an AMD CPU's AVX512-BF16); f32 elsewhere (an Intel CPU's
// AVX512-BF16 without AMX, AVX2, fp16 on any CPU). "16bit" on a CPU with no
// bf16 matmul is an error naming the ISA (fp16 keeps its rounded-tile path:
// no CPU here multiplies fp16). Throws kConfig naming kernels.gemm_inputs.
// `cpu` is this machine's facts unless a test gives others.
GemmInputsChoice resolve_gemm_inputs(const std::string& setting, DType precision,
                                     const std::string& device,
                                     const cpu::Bf16MatmulFacts& cpu = cpu::bf16_matmul_facts());

}  // namespace loom
