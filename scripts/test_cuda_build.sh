#!/usr/bin/env bash
# CI's CUDA build (docs/cuda.md): the whole tree with -DLOOM_CUDA=ON and
# every warning an error, then what a machine without a GPU can check: the
# CUDA build's refusals, by their messages. On a machine with a GPU the
# GPU tests run instead (scripts/gpu_check.sh runs them with the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
if [ ! -x "$nvcc" ]; then
  echo "test_cuda_build: no CUDA toolkit at $nvcc: the CUDA build is not checked on this machine"
  exit 0
fi
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DLOOM_WERROR=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
cmake --build build-cuda
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  build-cuda/tests/loom_unit_tests --gtest_filter='Cuda.*'
  build-cuda/tests/loom_backend_tests
  exit 0
fi
export OMP_NUM_THREADS=1
build-cuda/tests/loom_unit_tests --gtest_filter='Cuda.*:ConfigTable.*'
build-cuda/tests/loom_backend_tests --gtest_filter='*CoversEveryOperation*' |
  grep "the CUDA backend is built but not tested: no CUDA device"
# The CLI on a machine without a GPU: the run ends with the reason.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/run.json" <<'JSON'
{"train_batch_size": 4, "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "seq_len": 16},
 "data": {"synthetic": true}, "train": {"steps": 1}, "device": "cuda"}
JSON
if out=$(build-cuda/apps/loom/loom train --config "$tmp/run.json" --out "$tmp/run" 2>&1); then
  echo "test_cuda_build: device cuda trained on a machine without a GPU"
  exit 1
fi
echo "$out" | grep -q "device: cuda, but this machine has no CUDA device" || {
  echo "test_cuda_build: unexpected message: $out"
  exit 1
}
echo "test_cuda_build: CUDA build ok (warnings as errors); refusals without a GPU ok"
