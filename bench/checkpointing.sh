#!/usr/bin/env bash
# Activation checkpointing policies side by side: the peak of the tracker's
# `activations` category during a step and the median step time, against
# `none` measured in the same rounds (rounds alternate the policies so that
# all see the same machine state), beside the per-layer estimates of
# Korthikanti et al. 2022 scaled to f32.
#
#   bench/checkpointing.sh [CONFIG...]   (default: gpt-m and gpt-deep)
#   ROUNDS=3 STEPS=5 WARMUP=2 BUDGET_FRACTION=0.5 bench/checkpointing.sh configs/bench/gpt-m.json
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
rounds=${ROUNDS:-3} steps=${STEPS:-5} warmup=${WARMUP:-2} fraction=${BUDGET_FRACTION:-0.5}
configs=("$@")
((${#configs[@]})) || configs=(configs/bench/gpt-m.json configs/bench/gpt-deep.json)
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "# $cpu, $(nproc) cores, ${rounds} rounds of ${steps} steps (${warmup} warm-up), f32"
run() {  # config, policy overrides...
  local cfg=$1
  shift
  "$loom" bench train --config "$cfg" --steps "$steps" --warmup "$warmup" \
    --set log.peak_gflops=100 "$@" --json
}
for cfg in "${configs[@]}"; do
  out=$(mktemp)
  # The budget: a fraction of what `none` keeps per micro-batch.
  none_bytes=$("$loom" bench train --config "$cfg" --steps 2 --warmup 1 --set log.peak_gflops=100 \
    --json | python3 -c \
    'import json,sys; print(json.load(sys.stdin)["activation_checkpointing"]["store_bytes"])')
  budget=$(python3 -c "print(int($none_bytes * $fraction))")
  for ((r = 0; r < rounds; r++)); do
    for policy in none selective full budget; do
      extra=(--set activation_checkpointing.policy=$policy)
      [[ $policy == budget ]] && extra+=(--set activation_checkpointing.budget_bytes=$budget)
      run "$cfg" "${extra[@]}" | sed "s/^/$policy /" >> "$out"
    done
  done
  python3 - "$cfg" "$out" "$budget" <<'PY'
import json, statistics as S, sys
cfg_path, path, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = json.load(open(cfg_path))
m = cfg["model"]
runs = {}
for line in open(path):
    policy, _, js = line.partition(" ")
    runs.setdefault(policy, []).append(json.loads(js))
s, b, h, a, L = m["seq_len"], cfg["train_micro_batch_size_per_gpu"], m["n_embd"], m["n_head"], m["n_layer"]
sbh = s * b * h
# Korthikanti et al. 2022, per layer in 16-bit: sbh(34 + 5as/h) bytes, of
# which the dropout masks (sbh + as^2 b) are 1 byte per element. In f32 the
# 2-byte tensors double and the masks stay: sbh(66 + 9as/h). Full
# recomputation keeps the layer's input: 2sbh in 16-bit, 4sbh in f32.
est_none = L * sbh * (66 + 9 * a * s / h)
est_full = L * 4 * sbh
print(f"\n{cfg_path}: n_layer {L}, n_embd {h}, n_head {a}, seq_len {s}, micro-batch {b}, "
      f"vocab {m['vocab_size']}")
print(f"Korthikanti (f32) per layer: none {sbh*(66+9*a*s/h)/1e6:.1f} MB, full {4*sbh/1e6:.1f} MB; "
      f"x {L} layers: none {est_none/1e6:.0f} MB, full {est_full/1e6:.0f} MB")
first = runs["none"][0]["activation_checkpointing"]
print(f"loom per block: whole {first['block_bytes_whole']/1e6:.1f} MB, "
      f"recomputed {first['block_bytes_full']/1e6:.1f} MB; budget {budget/1e6:.0f} MB")
base_t = S.median(r["step_time_s"] for r in runs["none"])
base_m = S.median(r["peak_bytes"]["activations"] for r in runs["none"])
print(f"{'policy':10} {'activations MB':>15} {'vs none':>8} {'step s (median)':>16} {'vs none':>8} "
      f"{'recompute s':>12}  plan")
for policy, rs in runs.items():
    t = S.median(r["step_time_s"] for r in rs)
    mem = S.median(r["peak_bytes"]["activations"] for r in rs)
    rc = S.median(r["activation_checkpointing"]["recompute_time_s"] for r in rs)
    print(f"{policy:10} {mem/1e6:15.1f} {mem/base_m-1:+8.1%} {t:16.3f} {t/base_t-1:+8.1%} "
          f"{rc:12.3f}  {rs[0]['activation_checkpointing']['plan']}")
PY
  rm -f "$out"
done
