#!/usr/bin/env bash
# Expert parallelism on this machine: a mixture-of-experts variant of gpt-s
# (configs/bench/gpt-s.json with 8 experts, top-2, in every other block, no
# dropping) on N data-parallel ranks of one thread each, every rank holding
# all experts (ep 1) or E / ep of them (ep 2, ..., N): tokens/s, the step
# time against ep 1, the share of the step in the MoE all-to-alls and in all
# communication, the bytes a rank sends per step, and the parameter bytes
# per rank (the peak of the tracker's `params` category). Rounds alternate; medians over steps 2..,
# then over rounds.
#
#   bench/expert_parallel.sh                 RANKS=2 EPS="1 2" ROUNDS=3 STEPS=8
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
cfg=configs/bench/gpt-s.json
ranks=${RANKS:-2} eps=${EPS:-"1 2"} rounds=${ROUNDS:-3} steps=${STEPS:-8}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "# $cpu, $(nproc) cores, $ranks ranks of 1 thread, $rounds rounds of $steps steps, f32"
for ((r = 1; r <= rounds; r++)); do
  for ep in $eps; do
    OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -np "$ranks" "$loom" train \
      --config "$cfg" --set train.steps="$steps" --set checkpoint.every=0 \
      --set 'model.moe={"num_experts": 8, "top_k": 2, "every_n_layers": 2}' \
      --set parallel.expert="$ep" --set log.peak_gflops=100 --out "$work/ep$ep-r$r" \
      > "$work/log-$ep-$r.txt" 2>&1 || { cat "$work/log-$ep-$r.txt"; exit 1; }
  done
done
python3 - "$work" "$rounds" "$eps" <<'PY'
import json, statistics as S, sys
work, rounds, eps = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
print(f"{'ep':>3} {'tokens/s':>9} {'step s':>8} {'vs ep 1':>8} {'all-to-all':>11} {'all comm':>9} "
      f"{'comm MB/step':>13} {'params MB/rank':>15}")
base = None
for ep in eps:
    runs = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{work}/ep{ep}-r{r}/metrics.jsonl")][1:]
        runs.append((S.median(l["tokens_per_s"] for l in lines), S.median(l["time"]["step"] for l in lines),
                     S.median(l["time"]["all_to_all"] / l["time"]["step"] for l in lines),
                     S.median(l["time"]["comm"] / l["time"]["step"] for l in lines),
                     max(l["mem"]["params"] for l in lines), S.median(l["comm_bytes"] for l in lines)))
    tps, step, a2a, comm, params, mb = (S.median(x[i] for x in runs) for i in range(6))
    base = base or step
    print(f"{ep:>3} {tps:9.0f} {step:8.3f} {step/base:7.2f}x {a2a:11.1%} {comm:9.1%} {mb/1e6:13.1f} "
          f"{params/1e6:15.2f}")
PY
