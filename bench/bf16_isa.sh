#!/usr/bin/env bash
# bf16 against f32 on gpt-m as CPUs with fewer matrix instructions see it:
# oneDNN capped by ONEDNN_MAX_CPU_ISA at each of ISAS (default: this CPU's
# own, AVX512_CORE_BF16, AVX2). For each: f32, bf16 with kernels.gemm_inputs
# auto (the default: bf16 GEMM inputs where cpu::bf16_matmul_pays), and bf16
# with f32 and with 16-bit GEMM inputs pinned; ROUNDS alternating rounds, median
# tokens/s, each against f32 under the same cap. (The cap binds oneDNN's
# kernels alone: OpenBLAS and loom's own kernels keep the CPU's.)
#
#   bench/bf16_isa.sh [CONFIG]           (default configs/bench/gpt-m.json)
#   ROUNDS=3 STEPS=5 WARMUP=1 ISAS="ALL AVX2" bench/bf16_isa.sh
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
cfg=${1:-configs/bench/gpt-m.json}
rounds=${ROUNDS:-3} steps=${STEPS:-5} warmup=${WARMUP:-1} threads=${THREADS:-2}
isas=${ISAS:-ALL AVX512_CORE_BF16 AVX2}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $threads threads, $cfg, $rounds rounds of $steps steps ($warmup warm-up)"
runs=("f32|" "bf16 auto|--set bf16.enabled=true"
  "bf16, f32 GEMM inputs|--set bf16.enabled=true --set kernels.gemm_inputs=f32"
  "bf16, 16-bit GEMM inputs|--set bf16.enabled=true --set kernels.gemm_inputs=16bit")
for ((r = 0; r < rounds; r++)); do
  for isa in $isas; do
    for run in "${runs[@]}"; do
      name=${run%%|*} flags=${run#*|}
      # shellcheck disable=SC2086
      if j=$(ONEDNN_MAX_CPU_ISA=$isa OMP_NUM_THREADS=$threads "$loom" bench train --config "$cfg" \
        --steps "$steps" --warmup "$warmup" $flags --json 2>&1); then
        echo "$isa|$name|$j" >> "$out"
      else
        echo "$isa|$name|{\"error\": $(printf '%s' "$j" | tail -1 | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))')}" >> "$out"
      fi
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    isa, name, js = line.rstrip("\n").split("|", 2)
    rows.setdefault((isa, name), []).append(json.loads(js))
print(f"{'ONEDNN_MAX_CPU_ISA':20} {'run':28} {'GEMM path':12} {'tokens/s':>9} {'vs f32':>7}  runs")
for isa in dict.fromkeys(k[0] for k in rows):
    f32 = statistics.median(j["tokens_per_s"] for j in rows[(isa, "f32")])
    for (i, name), js in rows.items():
        if i != isa:
            continue
        if "error" in js[0]:
            print(f"{isa:20} {name:28} {'-':12} {'-':>9} {'-':>7}  {js[0]['error'][:100]}")
            continue
        med = statistics.median(j["tokens_per_s"] for j in js)
        runs = " ".join(f"{j['tokens_per_s']:.0f}" for j in js)
        print(f"{isa:20} {name:28} {js[0]['gemm_path']:12} {med:9.0f} {med / f32:6.2f}x  {runs}")
PY
