#!/usr/bin/env bash
# loom vs PyTorch 1.13 (Debian's python3-torch) training the same model,
# batch and optimizer, side by side on this machine. Rounds alternate the two
# so that both see the same machine state; medians and the ratio are printed.
#
#   bench/compare_torch.sh [CONFIG...]   (default: configs/bench/gpt-m.json)
#   ROUNDS=3 STEPS=6 WARMUP=2 THREADS=2 bench/compare_torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM_SETUP_BENCH=1 scripts/setup.sh >/dev/null
loom=${LOOM:-build/apps/loom/loom}
rounds=${ROUNDS:-3} steps=${STEPS:-6} warmup=${WARMUP:-2} threads=${THREADS:-2}
configs=("$@")
((${#configs[@]})) || configs=(configs/bench/gpt-m.json)
peak=$(OMP_NUM_THREADS=$threads "$loom" bench gemm --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["peak_gflops"])')
echo "# peak sgemm ${peak} GFLOP/s, ${threads} threads, ${rounds} rounds of ${steps} steps (${warmup} warm-up)"
# PyTorch's BLAS is Debian's libblas.so.3 alternative (OpenBLAS, pthread build);
# the 'torch+omp-blas' rows run it on OpenBLAS's OpenMP build, as loom links
# it, once with OpenMP's default (active) waiting and once passive. PyTorch
# gets its best configuration here: when OpenBLAS does not recognise this
# processor (loom says so), the script sets OPENBLAS_CORETYPE to the kernel
# the CPU supports for every PyTorch row.
omp_blas=/usr/lib/$(gcc -print-multiarch)/openblas-openmp
torch_env=()
if "$loom" bench gemm --sizes 64 --reps 1 --backend openblas --json | grep -q '"warning"'; then
  core=Haswell
  grep -qw avx512f /proc/cpuinfo && core=SkylakeX
  torch_env=(OPENBLAS_CORETYPE=$core)
  echo "# OpenBLAS misdetects this CPU: PyTorch runs with OPENBLAS_CORETYPE=$core"
fi
for cfg in "${configs[@]}"; do
  out=$(mktemp)
  for ((r = 0; r < rounds; r++)); do
    OMP_NUM_THREADS=$threads "$loom" bench train --config "$cfg" --steps "$steps" --warmup "$warmup" \
      --set log.peak_gflops="$peak" --json | sed 's/^/loom /' >> "$out"
    env "${torch_env[@]}" /usr/bin/python3 bench/torch_gpt.py --config "$cfg" --steps "$steps" \
      --warmup "$warmup" --threads "$threads" | sed 's/^/torch /' >> "$out"
    if [[ -d $omp_blas ]]; then
      env "${torch_env[@]}" LD_LIBRARY_PATH=$omp_blas /usr/bin/python3 bench/torch_gpt.py \
        --config "$cfg" --steps "$steps" --warmup "$warmup" --threads "$threads" |
        sed 's/^/torch+omp-blas /' >> "$out"
      env "${torch_env[@]}" LD_LIBRARY_PATH=$omp_blas OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 \
        bench/torch_gpt.py --config "$cfg" --steps "$steps" --warmup "$warmup" --threads "$threads" |
        sed 's/^/torch+omp-blas+passive /' >> "$out"
    fi
  done
  python3 - "$cfg" "$out" "$peak" <<'PY'
import json, statistics, sys
cfg, path, peak = sys.argv[1], sys.argv[2], float(sys.argv[3])
runs = {}
for line in open(path):
    impl, _, js = line.partition(" ")
    runs.setdefault(impl, []).append(json.loads(js)["tokens_per_s"])
loom = json.loads([l for l in open(path) if l.startswith("loom ")][0].partition(" ")[2])
fpt = loom["model_flops_per_s"] / loom["tokens_per_s"]
print(f"\n{cfg}: {loom['params']/1e6:.2f}M params, {loom['tokens_per_step']:.0f} tokens/step, {fpt/1e6:.1f} MFLOP/token")
print(f"{'impl':24} {'tokens/s (median)':>18} {'runs':>30} {'MFU':>6} {'loom / impl':>12}")
base = statistics.median(runs["loom"])
for impl, v in runs.items():
    med = statistics.median(v)
    print(f"{impl:24} {med:18.1f} {' '.join(f'{x:.0f}' for x in v):>30} {fpt*med/peak/1e9:6.1%} {base/med:12.2f}x")
best = max((statistics.median(v), k) for k, v in runs.items() if k != "loom")
print(f"loom / PyTorch's best ({best[1]}): {base/best[0]:.2f}x; loom at {fpt*base/peak/1e9:.1%} of the "
      f"GEMM-bound ceiling (model FLOP/s against the peak sgemm)")
PY
  rm -f "$out"
done
