#!/usr/bin/env bash
# loom vs PyTorch 1.13 (Debian's python3-torch) training the same model,
# batch and optimizer, side by side on this machine. Rounds alternate the two
# so that both see the same machine state; medians and the ratio are printed.
# Two precisions: f32 (loom f32 against PyTorch's best f32 setting) and bf16
# (loom `bf16.enabled`, its GEMM inputs as kernels.gemm_inputs auto picks
# them, against PyTorch's torch.autocast("cpu", torch.bfloat16), f32 master
# weights, at its best setting). BF16=0 leaves the bf16 rows out.
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
bf16=${BF16:-1}
peak=$(OMP_NUM_THREADS=$threads "$loom" bench gemm --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["peak_gflops"])')
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); oneDNN ISA $("$loom" bench gemm --sizes 64 --reps 1 --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["backends"].get("onednn", {}).get("isa", "none"))')"
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
    if ((bf16)); then
      OMP_NUM_THREADS=$threads "$loom" bench train --config "$cfg" --steps "$steps" --warmup "$warmup" \
        --set bf16.enabled=true --json | sed 's/^/loom-bf16 /' >> "$out"
      env "${torch_env[@]}" /usr/bin/python3 bench/torch_gpt.py --config "$cfg" --steps "$steps" \
        --warmup "$warmup" --threads "$threads" --autocast bf16 | sed 's/^/torch-bf16 /' >> "$out"
      env "${torch_env[@]}" OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 bench/torch_gpt.py --config "$cfg" \
        --steps "$steps" --warmup "$warmup" --threads "$threads" --autocast bf16 |
        sed 's/^/torch-bf16+passive /' >> "$out"
    fi
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
base16 = statistics.median(runs["loom-bf16"]) if "loom-bf16" in runs else None
# bf16 rows' MFU against the peak of the path loom's bf16 GEMMs take (its
# bf16 matmul peak where they run in bf16), the f32 rows' against the sgemm's.
b16 = [json.loads(l.partition(" ")[2]) for l in open(path) if l.startswith("loom-bf16 ")]
peak16 = b16[0]["peak_gflops"] if b16 else peak
for impl, v in runs.items():
    med = statistics.median(v)
    half = "bf16" in impl
    ref, pk = (base16, peak16) if half else (base, peak)
    print(f"{impl:24} {med:18.1f} {' '.join(f'{x:.0f}' for x in v):>30} {fpt*med/pk/1e9:6.1%} {ref/med:12.2f}x")
f32_impls = {k: v for k, v in runs.items() if k.startswith("torch") and "bf16" not in k}
best = max((statistics.median(v), k) for k, v in f32_impls.items())
print(f"loom / PyTorch's best ({best[1]}): {base/best[0]:.2f}x; loom at {fpt*base/peak/1e9:.1%} of the "
      f"GEMM-bound ceiling (model FLOP/s against the peak sgemm)")
if base16 is not None:
    best16 = max((statistics.median(v), k) for k, v in runs.items() if k.startswith("torch-bf16"))
    print(f"bf16: loom ({b16[0]['gemm_path']}, peak {peak16:.0f} GFLOP/s) / PyTorch's best autocast "
          f"({best16[1]}): {base16/best16[0]:.2f}x; loom bf16 / loom f32: {base16/base:.2f}x; loom "
          f"bf16 at {fpt*base16/peak16/1e9:.1%} of its GEMM-bound ceiling")
PY
  rm -f "$out"
done
