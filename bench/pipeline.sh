#!/usr/bin/env bash
# Pipeline parallelism on this machine.
#
# 1. The bubble: for p = 2 and 4 stages and m = 4, 8, 16 micro-batches, each
#    schedule's measured idle share (metrics.jsonl's bubble_fraction: the
#    most idle rank's time without compute over its schedule time, median
#    over the steps after the first) beside the theory: (p-1)/(m+p-1) for
#    GPipe and 1F1B, (p-1)/(vm+p-1) interleaved (v = 2), and about a third
#    of 1F1B's idle time for zero-bubble (ZB-H1, with F = B = W).
# 2. Balance: a model with a large vocabulary (the head outweighs many
#    blocks) cut uniformly and by the measured costs (parallel.partition
#    balanced), tokens/s of each and the ratio, rounds alternating.
#
# One thread per rank. With fewer cores than ranks (p = 4 on 2 cores) the
# ranks share cores: a stage's compute then stretches while another runs,
# so those figures mix the schedule's bubble with core sharing.
#
#   bench/pipeline.sh                 PS="2 4" MS="4 8 16" STEPS=5 ROUNDS=3
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
ps=${PS:-"2 4"} ms=${MS:-"4 8 16"} steps=${STEPS:-5} rounds=${ROUNDS:-3}
scheds=${SCHEDULES:-"gpipe 1f1b interleaved zero_bubble"}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # name ranks config overrides...
  local name=$1 np=$2 cfg=$3
  shift 3
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  mpirun --oversubscribe --bind-to none -np "$np" "$loom" train --config "$cfg" \
    --set train.steps="$steps" --set log.peak_gflops=100 "${sets[@]}" --out "$work/$name" \
    > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
}
echo "# $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc --all) cores, one thread per rank, f32"
for p in $ps; do
  for m in $ms; do
    for s in $scheds; do
      extra=()
      if [[ $s == interleaved ]]; then
        ((m % p == 0)) || continue
        extra=(parallel.virtual_stages=2)
      fi
      run "b-$p-$m-$s" "$p" configs/bench/gpt-pipe.json parallel.pipeline="$p" \
        gradient_accumulation_steps="$m" parallel.schedule="$s" "${extra[@]}"
    done
  done
done
for ((r = 1; r <= rounds; r++)); do
  for part in uniform balanced; do
    run "v-$part-$r" 2 configs/bench/gpt-vocab.json parallel.pipeline=2 parallel.partition=$part
  done
done
python3 - "$work" "$ps" "$ms" "$scheds" "$rounds" <<'PY'
import json, re, statistics as S, sys
work, ps, ms, scheds, rounds = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4].split(), int(sys.argv[5])
print("#", re.search(r"loom: (GEMM [^\n]*)", open(f"{work}/v-uniform-1.log").read()).group(1))
def metrics(name):
    return [json.loads(l) for l in open(f"{work}/{name}/metrics.jsonl")][1:]  # skip step 1
def theory(s, p, m, v=2):
    idle = p - 1
    if s == "interleaved": idle /= v
    if s == "zero_bubble": idle /= 3
    return idle / (m + idle)
print("\nconfigs/bench/gpt-pipe.json (8 layers, n_embd 256, micro-batch 2 x 128 tokens)")
print(f"{'p':>2} {'m':>3} {'schedule':>12} {'bubble':>8} {'theory':>8} {'step s':>8} {'tokens/s':>9}")
for p in map(int, ps):
    for m in map(int, ms):
        for s in scheds:
            try:
                lines = metrics(f"b-{p}-{m}-{s}")
            except FileNotFoundError:
                continue
            b = S.median(l["bubble_fraction"] for l in lines)
            step = S.median(l["time"]["step"] for l in lines)
            tps = S.median(l["tokens_per_s"] for l in lines)
            print(f"{p:>2} {m:>3} {s:>12} {b:8.1%} {theory(s, p, m):8.1%} {step:8.3f} {tps:9.0f}")
print("\nconfigs/bench/gpt-vocab.json (12 layers, n_embd 256, vocabulary 50257), pp 2, 1F1B, m 8")
res = {}
for part in ("uniform", "balanced"):
    res[part] = S.median(S.median(l["tokens_per_s"] for l in metrics(f"v-{part}-{r}")) for r in range(1, rounds + 1))
    log = open(f"{work}/v-{part}-1.log").read()
    print(re.search(r"blocks per part [^\n]*", log).group(0))
    if part == "balanced":
        print(log[log.index("loom: balanced partition"):log.index("loom: data")].rstrip())
for part in ("uniform", "balanced"):
    print(f"{part:>9}: {res[part]:7.0f} tokens/s")
print(f"balanced / uniform: {res['balanced'] / res['uniform']:.2f}x")
PY
