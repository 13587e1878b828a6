#!/usr/bin/env bash
# The GPU checks of the CUDA backend, in one go on a machine with an NVIDIA
# GPU (docs/cuda.md): build with -DLOOM_CUDA=ON, run the backend harness
# with the CUDA backend, the Cuda.* unit tests, the demo config's first 20
# steps on the GPU against the CPU (f32, losses within 1e-4 relative), and
# the figures (tokens/s and MFU against the dense bf16 peak) of gpt-m and a
# GPT-2 124M shape at seq 1024 in bf16. Made to finish within 5 minutes on
# a 16-core machine; prints one summary line per check and writes them to
# $OUT/gpu_check.txt when OUT is set.
#
#   scripts/gpu_check.sh                 # everything
#   BUILD=build-gpu PEAK_GFLOPS=989000 scripts/gpu_check.sh
#
# Needs the build's dependencies (scripts/setup.sh installs them on Debian);
# the script names any that are missing before it builds.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
PEAK_GFLOPS=${PEAK_GFLOPS:-989000}  # H100/H200 SXM dense bf16, GFLOP/s
JOBS=${JOBS:-$(nproc)}
SUMMARY=${OUT:-/tmp}/gpu_check.txt
: >"$SUMMARY"
say() { echo "gpu_check: $*" | tee -a "$SUMMARY"; }
fail=0

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader | sed 's/^/gpu_check: gpu: /' | tee -a "$SUMMARY"
missing=()
for tool in cmake ninja nvcc mpirun; do
  command -v "$tool" >/dev/null || [ "$tool" = nvcc -a -x /usr/local/cuda/bin/nvcc ] || missing+=("$tool")
done
for header in cblas.h nlohmann/json.hpp CLI/CLI.hpp gtest/gtest.h unicode/uchar.h openssl/sha.h; do
  echo "#include <$header>" | c++ -x c++ -fsyntax-only - ${CPATH:+-I$CPATH} 2>/dev/null ||
    missing+=("$header")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "FAIL missing build dependencies: ${missing[*]} (scripts/setup.sh installs them on Debian)"
  exit 1
fi

t0=$(date +%s)
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DLOOM_WERROR=ON \
         -DLOOM_ONEDNN=OFF -DLOOM_NATIVE=OFF >/dev/null &&
       cmake --build "$BUILD" -j "$JOBS" --target loom loom_unit_tests loom_backend_tests; }; then
  say "FAIL build"
  exit 1
fi
say "build ok ($(($(date +%s) - t0)) s)"

loom="$BUILD/apps/loom/loom"

# 1. Every operation of the CUDA backend against the reference.
if "$BUILD"/tests/loom_backend_tests --gtest_filter='*cuda*' >"${OUT:-/tmp}/backend_ops.log" 2>&1; then
  say "backend ops ok: $(grep -c '^\[       OK' "${OUT:-/tmp}/backend_ops.log") cases on the CUDA backend"
else
  say "FAIL backend ops: $(grep -E '^\[  FAILED' "${OUT:-/tmp}/backend_ops.log" | head -5 | tr '\n' ' ')"
  fail=1
fi

# 2. The GPU run against the CPU run, checkpoints across devices, NCCL.
if "$BUILD"/tests/loom_unit_tests --gtest_filter='Cuda.*' >"${OUT:-/tmp}/cuda_tests.log" 2>&1; then
  say "Cuda.* ok: $(grep -E '^\[  (PASSED|SKIPPED)' "${OUT:-/tmp}/cuda_tests.log" | tr '\n' ' ')"
else
  say "FAIL Cuda.*: $(grep -E 'Failure|FAILED|Expected|Which' "${OUT:-/tmp}/cuda_tests.log" | head -8 | tr '\n' ' ')"
  fail=1
fi

# 3. gpt-m in f32, 20 steps on the GPU against the same steps on the CPU.
for dev in cpu cuda; do
  "$loom" train --config configs/bench/gpt-m.json --set device=$dev --set train.steps=20 \
    --set log.peak_gflops="$PEAK_GFLOPS" --out "/tmp/gpu_check_$dev" --overwrite >/dev/null 2>&1 ||
    { say "FAIL gpt-m f32 on $dev"; fail=1; }
done
if cmp=$(python3 - /tmp/gpu_check_cpu/metrics.jsonl /tmp/gpu_check_cuda/metrics.jsonl <<'PY'
import json, sys
def losses(p):
    return [json.loads(l)["loss"] for l in open(p) if '"loss"' in l]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print("%d steps, largest relative difference %.2e (loss %.4f -> %.4f)" % (len(a), worst, a[0], a[-1]))
sys.exit(0 if len(a) == len(b) == 20 and worst <= 1e-4 else 1)
PY
); then
  say "gpt-m f32 GPU vs CPU ok: $cmp"
else
  say "FAIL gpt-m f32 GPU vs CPU: $cmp"
  fail=1
fi

# 4. The figures: tokens/s and MFU against the dense bf16 peak.
for cfg in configs/bench/gpt-m.json configs/bench/gpt2-124m.json; do
  extra=()
  [ "$cfg" = configs/bench/gpt-m.json ] && extra=(--set bf16.enabled=true --set kernels.gemm_inputs=16bit)
  if j=$("$loom" bench train --config "$cfg" --set device=cuda --set log.peak_gflops="$PEAK_GFLOPS" \
        "${extra[@]}" --steps 12 --warmup 2 --json 2>"${OUT:-/tmp}/bench.err"); then
    say "$(basename "$cfg" .json) bf16 on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1): $(
      echo "$j" | python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.0f tokens/s, MFU %.1f%% of %.0f TFLOP/s, step %.4f s, gemm %s" % (j["tokens_per_s"], 100*j["mfu"], j["peak_gflops"]/1e3, j["step_time_s"], j["gemm_path"]))')"
  else
    say "FAIL bench $cfg: $(tail -3 "${OUT:-/tmp}/bench.err" | tr '\n' ' ')"
    fail=1
  fi
done
say "done in $(($(date +%s) - t0)) s; $([ $fail = 0 ] && echo 'all passed' || echo 'FAILURES above')"
exit $fail
