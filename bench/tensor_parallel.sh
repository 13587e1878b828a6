#!/usr/bin/env bash
# Tensor parallelism on this machine: activation bytes per rank (the peak of
# the tracker's `activations` category, maximum over ranks, from
# metrics.jsonl) at tp 1, 2, 4, with and without sequence parallelism
# ("2sp"), beside Korthikanti et al. 2022's per-layer estimates, and the step
# time against tp 1 with the same total threads (tp 1: one process of
# $THREADS threads; tp N: N processes of THREADS / N, at least 1), rounds
# alternating, with the communication share.
#
#   bench/tensor_parallel.sh [CONFIG]        (default: configs/bench/gpt-m.json)
#   ROUNDS=3 STEPS=6 THREADS=2 TPS="1 2 4 2sp 4sp" bench/tensor_parallel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
cfg=${1:-configs/bench/gpt-m.json}
rounds=${ROUNDS:-3} steps=${STEPS:-6} threads=${THREADS:-2} tps=${TPS:-"1 2 4 2sp 4sp"}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "# $cpu, $(nproc) cores, $threads threads in all, $rounds rounds of $steps steps, f32"
for ((r = 1; r <= rounds; r++)); do
  for name in $tps; do
    tp=${name%sp}
    sp=false
    [[ $name == *sp ]] && sp=true
    per=$((threads / tp > 0 ? threads / tp : 1))
    launch=()
    ((tp == 1)) || launch=(mpirun --oversubscribe --bind-to none -np "$tp")
    OMP_NUM_THREADS=$per "${launch[@]}" "$loom" train --config "$cfg" --set train.steps="$steps" \
      --set parallel.tensor="$tp" --set parallel.sequence_parallel=$sp \
      --set log.peak_gflops=100 --out "$work/tp$name-r$r" \
      > "$work/log-$name-$r.txt" 2>&1 || { cat "$work/log-$name-$r.txt"; exit 1; }
  done
done
python3 - "$work" "$rounds" "$tps" "$cfg" <<'PY'
import json, statistics as S, sys
work, rounds, tps, cfg_path = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4]
cfg = json.load(open(cfg_path)); m = cfg["model"]
s, b, h, a, L = m["seq_len"], cfg["train_micro_batch_size_per_gpu"], m["n_embd"], m["n_head"], m["n_layer"]
sbh = s * b * h
print(f"\n{cfg_path}: n_layer {L}, n_embd {h}, n_head {a}, seq_len {s}, micro-batch {b}, vocab {m['vocab_size']}")
# Korthikanti et al. 2022, per layer, 16-bit: tensor parallelism
# sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh(34/t + 5as/(ht));
# in f32 (2-byte tensors doubled, 1-byte masks kept): sbh(18 + 48/t +
# 9as/(ht)) and sbh(66/t + 9as/(ht)).
print(f"{'tp':>5} {'activations MB':>15} {'Korthikanti f32 MB':>19} {'step s':>8} {'vs tp 1':>8} "
      f"{'comm s':>8} {'comm share':>10}")
base = None
for name in tps:
    t, sp = int(name.rstrip("sp")), name.endswith("sp")
    runs = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{work}/tp{name}-r{r}/metrics.jsonl")][1:]  # skip step 1
        runs.append((S.median(l["time"]["step"] for l in lines), S.median(l["time"]["comm"] for l in lines),
                     max(l["mem"]["activations"] for l in lines)))
    step = S.median(x[0] for x in runs); comm = S.median(x[1] for x in runs); mem = S.median(x[2] for x in runs)
    base = base or step
    est = L * sbh * ((66 / t if sp else 18 + 48 / t) + 9 * a * s / (h * t))
    print(f"{name:>5} {mem/1e6:15.1f} {est/1e6:19.1f} {step:8.3f} {step/base:7.2f}x {comm:8.3f} {comm/step:10.1%}")
PY
