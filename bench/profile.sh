#!/usr/bin/env bash
# The profile-and-move-the-cut loop with log.profile: configs/bench/gpt-vocab.json
# (12 blocks, a 50257-token vocabulary whose head outweighs several blocks)
# on a 2-stage 1F1B pipeline, first cut uniformly ([6, 6]), then with the
# partition its load-imbalance report suggests; each run's report, and
# tokens/s of both (median of the steps after the first, ROUNDS rounds
# alternating). Usage: LOOM=build/apps/loom/loom bench/profile.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-build/apps/loom/loom}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-8}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
grep -m1 "model name" /proc/cpuinfo | sed 's/.*: /cpu: /'
echo "isa: $(grep -o -w -E 'avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"

run() {  # name partition
  mpirun --oversubscribe -np 2 --bind-to none "$LOOM" train --config configs/bench/gpt-vocab.json \
    --set parallel.pipeline=2 --set "parallel.partition=$2" --set train.steps="$STEPS" \
    --set log.profile=true --out "$work/$1" > "$work/$1.txt" 2>&1 ||
    { tail -20 "$work/$1.txt"; exit 1; }
}

run uniform-0 uniform
grep -m1 "loom: GEMM" "$work/uniform-0.txt"
echo; echo "== uniform [6, 6] =="
sed -n '/^load imbalance/,/^$/p' "$work/uniform-0.txt"
cut=$(python3 - "$work/uniform-0/profile.json" <<'PY'
import json, re, sys
s = json.load(open(sys.argv[1]))["imbalance"][0]["suggestion"]
m = re.search(r"parallel\.partition (\[[0-9, ]+\])", s)
print(m.group(1).replace(" ", "") if m else "")
PY
)
[[ -n $cut ]] || { echo "no partition suggested"; exit 1; }
run suggested-0 "$cut"
echo "== suggested $cut =="
sed -n '/^load imbalance/,/^$/p' "$work/suggested-0.txt"
for r in $(seq 1 $((ROUNDS - 1))); do run "uniform-$r" uniform; run "suggested-$r" "$cut"; done
python3 - "$work" "$ROUNDS" "$cut" <<'PY'
import json, statistics, sys
work, rounds, cut = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def tps(name):
    lines = [json.loads(l) for l in open(f"{work}/{name}/metrics.jsonl")]
    return statistics.median(l["tokens_per_s"] for l in lines[1:])
def imb(name):
    return json.load(open(f"{work}/{name}/profile.json"))["imbalance"][0]["imbalance"]
u = [tps(f"uniform-{r}") for r in range(rounds)]
s = [tps(f"suggested-{r}") for r in range(rounds)]
print("\n%-12s %14s %18s" % ("partition", "tokens/s", "compute imbalance"))
print("%-12s %14.0f %17.0f%%" % ("[6,6]", statistics.median(u), 100 * imb("uniform-0")))
print("%-12s %14.0f %17.0f%%" % (cut, statistics.median(s), 100 * imb("suggested-0")))
print("suggested / uniform tokens/s: %.2fx (medians of %d rounds: %s vs %s)" %
      (statistics.median(s) / statistics.median(u), rounds,
       " ".join("%.0f" % x for x in s), " ".join("%.0f" % x for x in u)))
PY
