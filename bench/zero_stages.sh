#!/usr/bin/env bash
# ZeRO stages 0-3 side by side under `mpirun -np N` (one thread per rank):
# step time against stage 0 measured in the same rounds (rounds alternate the
# stages so that all see the same machine state), communication, and the
# model-state bytes per rank from metrics.jsonl against the formulas.
#
#   bench/zero_stages.sh [CONFIG]          (default: configs/bench/gpt-s.json)
#   NP=2 ROUNDS=3 STEPS=12 STAGES="0 1 2 3" bench/zero_stages.sh configs/bench/gpt-m.json
#   NP=1 runs one process without mpirun.
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
cfg=${1:-configs/bench/gpt-s.json}
np=${NP:-2} rounds=${ROUNDS:-3} steps=${STEPS:-12} stages=${STAGES:-"0 1 2 3"}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
launch=()
((np == 1)) || launch=(mpirun --oversubscribe --bind-to none -np "$np")
for ((r = 1; r <= rounds; r++)); do
  for st in $stages; do
    "${launch[@]}" "$loom" train --config "$cfg" --set train.steps="$steps" \
      --set zero_optimization.stage="$st" --set log.peak_gflops=100 \
      --out "$work/s$st-r$r" > "$work/log-$st-$r.txt" 2>&1 ||
      { cat "$work/log-$st-$r.txt"; exit 1; }
  done
done
python3 - "$work" "$np" "$rounds" "$stages" "$cfg" <<'PY'
import json, statistics as S, sys
work, n, rounds, stages, cfg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(s) for s in sys.argv[4].split()], sys.argv[5]
def runs(st):
    for r in range(1, rounds + 1):
        yield [json.loads(l) for l in open(f"{work}/s{st}-r{r}/metrics.jsonl")]
# Warm-up: the first two steps (or one when there are fewer than four).
skip = lambda m: m[2:] if len(m) >= 4 else m[1:] if len(m) > 1 else m
res = {}
for st in stages:
    rr = [skip(m) for m in runs(st)]
    res[st] = {
        "step": [S.median(x["time"]["step"] for x in m) for m in rr],
        "comm": S.median(S.median(x["time"]["comm"] for x in m) for m in rr),
        "exposed": S.median(S.median(x["time"]["comm_exposed"] for x in m) for m in rr),
        "mem": rr[-1][-1]["mem"],
    }
# P: elements of the flat buffers as loom lays them out for stage st on n
# ranks: each parameter padded to 16 elements, each unit (embeddings, a
# layer, the final norm) from stage 1 on to a multiple of 16 n.
c = json.load(open(cfg))["model"]
C, T, L, Vp = c["n_embd"], c["seq_len"], c["n_layer"], (c["vocab_size"] + 127) // 128 * 128
up = lambda x, m: (x + m - 1) // m * m
units = [[Vp * C, T * C]] + [[C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C]] * L + [[C, C]]
def flat(st):
    mult = 16 * n if st >= 1 else 1
    return sum(up(sum(up(x, 16) for x in u), mult) for u in units)
print(f"# {cfg}, N = {n} ranks, {rounds} rounds of {len(next(runs(stages[0])))} steps; medians; "
      f"P = {flat(0):,} elements at stage 0")
print("| stage | step ms | vs stage 0 (per round) | comm ms | exposed ms | params | grads | optimizer | model state | formula | ratio | comm buffers |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
base = res.get(0)
for st in stages:
    r = res[st]; m = r["mem"]
    ratios = [a / b for a, b in zip(r["step"], base["step"])] if base else []
    model = m["params"] + m["grads"] + m["optimizer"]
    # P: elements of this run's flat buffers, read from stage 0-2's params bytes.
    P = flat(st)
    f = {0: 16 * P, 1: 8 * P + 8 * P / n, 2: 4 * P + 12 * P / n, 3: 16 * P / n}[st]
    rs = f"{S.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})" if ratios else "-"
    print(f"| {st} | {S.median(r['step'])*1e3:.0f} | {rs} | {r['comm']*1e3:.0f} | {r['exposed']*1e3:.0f} | "
          f"{m['params']:,} | {m['grads']:,} | {m['optimizer']:,} | {model:,} | {f:,.0f} | {model / f:.3f} | {m['comm']:,} |")
PY
