#!/usr/bin/env bash
# Checkpoint saves and resumes on this machine: gpt-m (configs/bench), two
# ranks of one thread, micro-batch 1, checkpoint.every 1.
#
# 1. Save against the bytes alone: the median seconds of a save (loom's
#    "checkpoint ... in X s" line: from the start of the save to the folder
#    in place and `latest` moved) for sharded checkpoints at ZeRO stages 3
#    and 1 (each rank writes its own file) and whole ones (world rank 0
#    writes whole tensors after the gather), beside the median seconds two
#    `dd conv=fsync` take to write files of the ranks' sizes at once into
#    the same folder.
# 2. Async: the median seconds training pauses per save (the state copied,
#    the file written in the background), and the extra wall time per save
#    of a run saving every step, sync and async, over one that never saves.
# 3. Resume: verifying and reading the stage-3 checkpoint on the 2 ranks
#    that wrote it, and the same checkpoint in one process.
#
#   bench/checkpoint.sh                 STEPS=8 ROUNDS=3
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
steps=${STEPS:-8} rounds=${ROUNDS:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d "${TMPDIR:-/tmp}/loom-bench-ckpt.XXXXXX")
trap 'rm -rf "$work"' EXIT
cfg=configs/bench/gpt-m.json
base=(--set train_micro_batch_size_per_gpu=1 --set log.peak_gflops=100 --set train.steps="$steps")
now() { date +%s.%N; }
train() {  # name ranks overrides... ; prints its wall seconds
  local name=$1 np=$2
  shift 2
  local sets=() t0
  for s in "$@"; do sets+=(--set "$s"); done
  rm -rf "$work/$name"
  t0=$(now)
  mpirun --oversubscribe --bind-to none -np "$np" "$loom" train --config "$cfg" "${base[@]}" \
    "${sets[@]}" --out "$work/$name" > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
  echo "$(now) - $t0" | bc
}
saves() {  # log -> the save seconds, one per line
  tr '\r' '\n' < "$1" | sed -n 's/.*loom: checkpoint .* in \([0-9.]*\) s.*/\1/p'
}
paused() { tr '\r' '\n' < "$1" | sed -n 's/.*training paused \([0-9.]*\) s.*/\1/p'; }
median() { sort -g | awk '{a[NR] = $1} END {print NR ? a[int((NR + 1) / 2)] : "nan"}'; }
dd_ranks() {  # folder -> seconds for dd to write files of each rank file's size at once
  local d=$1 t0
  t0=$(now)
  for f in "$d"/rank-*.safetensors "$d"/model.safetensors "$d"/optimizer.safetensors; do
    [[ -f $f ]] || continue
    dd if=/dev/zero of="$f.dd" bs=1M count=$(($(stat -c %s "$f") / 1048576)) conv=fsync status=none &
  done
  wait
  echo "$(now) - $t0" | bc
  rm -f "$d"/*.dd
}

fs=$(stat -f -c %T "$work")
echo "# $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc --all) cores, 2 ranks x 1 thread, $fs at $work"
echo "# gpt-m, $steps steps saving every step, $rounds rounds; medians"
printf "%-22s %9s %9s %9s %7s\n" checkpoint MB save_s bytes_s ratio
for mode in "sharded zero-3:3:sharded" "sharded zero-1:1:sharded" "whole zero-3:3:whole"; do
  IFS=: read -r label stage format <<< "$mode"
  s_all=() d_all=()
  for r in $(seq "$rounds"); do
    train ck 2 zero_optimization.stage="$stage" checkpoint.every=1 checkpoint.format="$format" \
      > /dev/null
    s_all+=($(saves "$work/ck.log"))
    last=$(ls -d "$work"/ck/checkpoints/step-* | tail -1)
    d_all+=($(dd_ranks "$last"))
  done
  mb=$(du -sb --exclude='*.json' "$last" | awk '{printf "%.1f", $1 / 1e6}')
  s=$(printf "%s\n" "${s_all[@]}" | median)
  d=$(printf "%s\n" "${d_all[@]}" | median)
  printf "%-22s %9s %9.3f %9.3f %7.2f\n" "$label" "$mb" "$s" "$d" "$(echo "$s / $d" | bc -l)"
done

echo
printf "%-34s %9s %9s %9s\n" "zero-3, per save" none sync async
w_none=() w_sync=() w_async=() p_all=()
for r in $(seq "$rounds"); do
  w_none+=($(train n 2 zero_optimization.stage=3 checkpoint.every=0))
  w_sync+=($(train s 2 zero_optimization.stage=3 checkpoint.every=1))
  w_async+=($(train a 2 zero_optimization.stage=3 checkpoint.every=1 checkpoint.async=true))
  p_all+=($(paused "$work/a.log" | head -n -1))  # the last save waits for the end of the run
done
n=$(printf "%s\n" "${w_none[@]}" | median)
sy=$(printf "%s\n" "${w_sync[@]}" | median)
as=$(printf "%s\n" "${w_async[@]}" | median)
printf "%-34s %9s %9.3f %9.3f\n" "extra wall seconds per save" "-" \
  "$(echo "($sy - $n) / $steps" | bc -l)" "$(echo "($as - $n) / $steps" | bc -l)"
printf "%-34s %9s %9s %9.3f\n" "training paused per save (median)" "-" "-" \
  "$(printf "%s\n" "${p_all[@]}" | median)"

echo
r_two=() r_one=()
ck=$(ls -d "$work"/s/checkpoints/step-* | tail -1)
for r in $(seq "$rounds"); do
  rm -rf "$work/r2" "$work/r1"
  mpirun --oversubscribe --bind-to none -np 2 "$loom" train --config "$cfg" "${base[@]}" \
    --set zero_optimization.stage=3 --set train.steps=$((steps + 1)) --resume "$ck" \
    --out "$work/r2" > "$work/r2.log" 2>&1 || { cat "$work/r2.log"; exit 1; }
  "$loom" train --config "$cfg" "${base[@]}" --set train.steps=$((steps + 1)) --resume "$ck" \
    --out "$work/r1" > "$work/r1.log" 2>&1 || { cat "$work/r1.log"; exit 1; }
  r_two+=($(sed -n 's/.*verified and read in \([0-9.]*\) s.*/\1/p' "$work/r2.log"))
  r_one+=($(sed -n 's/.*verified and read in \([0-9.]*\) s.*/\1/p' "$work/r1.log"))
done
printf "resume of the zero-3 checkpoint (verify + read): 2 ranks at zero-3 %.3f s, one process %.3f s\n" \
  "$(printf "%s\n" "${r_two[@]}" | median)" "$(printf "%s\n" "${r_one[@]}" | median)"
