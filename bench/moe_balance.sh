#!/usr/bin/env bash
# Load balancing of a mixture of experts on the demo data: the demo model
# (configs/demo.json) with 8 experts, top-2, in every other block, capacity
# factor 1.25, trained STEPS steps with aux_loss_coef 0 (no balancing), 0.01
# and 0.1, and with bias balancing (model.moe.balancing bias, no auxiliary
# loss, the bias moved by bias_update_rate RATE a step, 0.01 by default: at
# 1e-3 the bias cannot undo a collapse within 200 steps). Per run: the worst layer's load imbalance (busiest expert over
# the mean) and dropped share, each the mean over the last quarter of the
# steps, and the final training and validation loss.
#
#   bench/moe_balance.sh                 STEPS=200 COEFS="0 0.01 0.1 bias"
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
steps=${STEPS:-200} coefs=${COEFS:-"0 0.01 0.1 bias"}
[[ -f data/fortunes/train.bin ]] || { echo "run scripts/demo.sh once first (it prepares data/fortunes)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "# $(lscpu | sed -n 's/^Model name: *//p' | head -1), demo model + MoE (8 experts, top-2, blocks 1 and 3, capacity 1.25), $steps steps"
printf "%-14s %10s %9s %11s %9s\n" balancing imbalance dropped train_loss val_loss
for c in $coefs; do
  set_balance=(--set model.moe.aux_loss_coef="$c")
  [[ $c == bias ]] && set_balance=(--set model.moe.balancing=bias --set model.moe.bias_update_rate="${RATE:-0.01}")
  "$loom" train --config configs/demo.json --set train.steps="$steps" --set checkpoint.every=0 \
    --set scheduler.params.total_num_steps="$steps" --set train.eval_every="$steps" \
    --set 'model.moe={"num_experts": 8, "top_k": 2, "every_n_layers": 2, "capacity_factor": 1.25}' \
    "${set_balance[@]}" --out "$work/$c" > "$work/$c.log" 2>&1 ||
    { cat "$work/$c.log"; exit 1; }
  python3 - "$work/$c/metrics.jsonl" "$c" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
tail = lines[-max(1, len(lines) // 4):]
imb = sum(max(m["imbalance"] for m in l["moe"]) for l in tail) / len(tail)
drop = sum(max(m["dropped"] for m in l["moe"]) for l in tail) / len(tail)
val = next((l["val_loss"] for l in reversed(lines) if "val_loss" in l), float("nan"))
print(f"{sys.argv[2]:<14} {imb:10.3f} {100 * drop:8.2f}% {lines[-1]['loss']:11.4f} {val:9.4f}")
PY
done
