#!/usr/bin/env bash
# The architecture step against the commit before it, built side by side and
# run in alternating rounds (docs/performance.md, "The backend table"):
#   1. step time of configs/bench/gpt-m.json, f32 and bf16, in one process
#      and on 2 data-parallel ranks: the median step (steps after the first
#      two) of each build, and new / old;
#   2. the bytes one rank sends per step in a bf16 tp 2 x pp 2 run of
#      configs/bench/gpt-s.json: the old build's comm_bytes (a ring model of
#      the reductions and the payload of the rest) and the new build's (the
#      record of every operation), with the new one per group, and the new
#      build's with comm.payloads f32 (activations in f32, as before);
#   3. f32 losses of eight layouts over 20 steps (a narrower gpt-s), old
#      against new: the largest relative difference of any step.
#
#   PARTS=23 bench/architecture.sh        # parts 2 and 3 alone
#   bench/architecture.sh                 # BASE=4d12403 ROUNDS=3 STEPS=6
#   BASE=<commit> ROUNDS=5 bench/architecture.sh
set -euo pipefail
cd "$(dirname "$0")/.."
base=${BASE:-4d12403} rounds=${ROUNDS:-3} steps=${STEPS:-6} parts=${PARTS:-123}
new=${LOOM:-build/apps/loom/loom}
old_src=${OLD_SRC:-/tmp/loom-base-$base}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [[ ! -x $old_src/build/apps/loom/loom ]]; then
  rm -rf "$old_src"
  git worktree add --detach "$old_src" "$base" > /dev/null
  cmake -S "$old_src" -B "$old_src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
  cmake --build "$old_src/build" --target loom > /dev/null
fi
old=$old_src/build/apps/loom/loom
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cores=$(getconf _NPROCESSORS_ONLN)
echo "# machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $cores cores"
echo "# old: $base ($(git log -1 --format=%s "$base" | cut -c1-60)...), new: $(git rev-parse --short HEAD)"
run() {  # build precision layout round
  local bin=$1 p=$2 layout=$3 r=$4 out="$work/$1-$2-$3-$4"
  local exe=$new
  [[ $bin == old ]] && exe=$old
  local set=(--set train.steps="$steps" --set checkpoint.every=0 --set train.sample_tokens=0)
  [[ $p == bf16 ]] && set+=(--set bf16.enabled=true)
  if [[ $layout == one ]]; then
    OMP_NUM_THREADS=$cores "$exe" train --config configs/bench/gpt-m.json "${set[@]}" --out "$out" \
      > "$out.txt" 2>&1 || { cat "$out.txt"; exit 1; }
  else
    OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -np 2 "$exe" train \
      --config configs/bench/gpt-m.json "${set[@]}" --set train_batch_size=16 --out "$out" \
      > "$out.txt" 2>&1 || { cat "$out.txt"; exit 1; }
  fi
}
[[ $parts == *1* ]] || rounds=0
for ((r = 1; r <= rounds; r++)); do
  for p in f32 bf16; do
    for layout in one dp2; do
      run old $p $layout $r
      run new $p $layout $r
    done
  done
done
[[ $rounds -gt 0 ]] && { grep -m1 "^loom: GEMM" "$work/new-f32-one-1.txt" || true; }
tpp() {  # build out [--set ...]
  local exe=$new
  [[ $1 == old ]] && exe=$old
  local out=$work/$2
  shift 2
  OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -np 4 "$exe" train \
    --config configs/bench/gpt-s.json --set bf16.enabled=true --set parallel.tensor=2 \
    --set parallel.pipeline=2 --set gradient_accumulation_steps=4 --set train.steps=4 \
    --set checkpoint.every=0 --set train.sample_tokens=0 "$@" --out "$out" \
    > "$out.txt" 2>&1 || { cat "$out.txt"; exit 1; }
}
if [[ $parts == *2* ]]; then
  tpp old old-tpp
  tpp new new-tpp
  tpp new new-tpp-f32 --set comm.payloads=f32
fi
layouts=("one:1:" "dp 2:2:--set parallel.data=2" "dp 2 zero-2:2:--set parallel.data=2 --set zero_optimization.stage=2"
  "dp 2 zero-3:2:--set parallel.data=2 --set zero_optimization.stage=3"
  "tp 2:2:--set parallel.tensor=2"
  "pp 2 1f1b:2:--set parallel.pipeline=2 --set gradient_accumulation_steps=4 --set parallel.schedule=1f1b"
  "tp 2 x pp 2:4:--set parallel.tensor=2 --set parallel.pipeline=2 --set gradient_accumulation_steps=4"
  "moe ep 2:2:--set parallel.data=2 --set parallel.expert=2 --set model.moe.num_experts=4 --set model.moe.every_n_layers=2")
if [[ $parts == *3* ]]; then
  for ((k = 0; k < ${#layouts[@]}; k++)); do
    IFS=: read -r name np keys <<< "${layouts[$k]}"
    for bin in old new; do
      exe=$new
      [[ $bin == old ]] && exe=$old
      # shellcheck disable=SC2086
      OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -np "$np" "$exe" train \
        --config configs/bench/gpt-s.json --set model.n_embd=64 --set model.seq_len=64 \
        --set train.steps=20 --set checkpoint.every=0 --set train.sample_tokens=0 $keys \
        --out "$work/$bin-loss-$k" > "$work/$bin-loss-$k.txt" 2>&1 ||
        { cat "$work/$bin-loss-$k.txt"; exit 1; }
    done
    echo "$name" > "$work/loss-$k.name"
  done
fi
python3 - "$work" "$rounds" "$parts" <<'PY'
import json, os, statistics as S, sys
work, rounds, parts = sys.argv[1], int(sys.argv[2]), sys.argv[3]
load = lambda d: [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
if rounds:
  print("\n| run | old step (s) | new step (s) | new / old |\n|---|---|---|---|")
for p in ("f32", "bf16") if rounds else ():
    for layout in ("one", "dp2"):
        med = {b: S.median(l["time"]["step"] for r in range(1, rounds + 1)
                           for l in load(f"{work}/{b}-{p}-{layout}-{r}")[2:]) for b in ("old", "new")}
        name = f"gpt-m {p}, " + ("one process" if layout == "one" else "dp 2")
        print(f"| {name} | {med['old']:.3f} | {med['new']:.3f} | {med['new'] / med['old']:.3f} |")
if "2" in parts:
  old, new, f32 = load(f"{work}/old-tpp"), load(f"{work}/new-tpp"), load(f"{work}/new-tpp-f32")
  print("\nbf16 tp 2 x pp 2 (gpt-s, 4 micro-batches), bytes rank 0 sends per step (median of 4 steps):")
  print(f"  old comm_bytes (model): {S.median(l['comm_bytes'] for l in old) / 1e6:.3f} MB")
  print(f"  new, comm.payloads f32 (record): {S.median(l['comm_bytes'] for l in f32) / 1e6:.3f} MB")
  print(f"  new comm_bytes (record): {S.median(l['comm_bytes'] for l in new) / 1e6:.3f} MB")
  for name, run in (("payloads f32", f32), ("new", new)):
    for g in run[-1].get("comm_groups", {}):
      print(f"    {name} {g}: {S.median(l['comm_groups'][g]['bytes'] for l in run) / 1e6:.3f} MB, "
            f"{run[-1]['comm_groups'][g]['ops']} operations")
if "3" in parts:
  print("\n| f32 layout, 20 steps | max relative loss difference, new vs old |\n|---|---|")
  k = 0
  while os.path.exists(f"{work}/loss-{k}.name"):
    name = open(f"{work}/loss-{k}.name").read().strip()
    a = [l["loss"] for l in load(f"{work}/old-loss-{k}")]
    b = [l["loss"] for l in load(f"{work}/new-loss-{k}")]
    assert len(a) == len(b) == 20, (name, len(a), len(b))
    print(f"| {name} | {max(abs(x - y) / abs(x) for x, y in zip(a, b)):.2e} |")
    k += 1
PY
