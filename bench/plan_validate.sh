#!/usr/bin/env bash
# loom plan against this machine: predicted step time and peak memory
# against what training measures, for layouts of every kind (dp with ZeRO
# 0-3, tp with and without sequence parallelism, pp under each schedule,
# the recompute policies, 16-bit, MoE with expert parallelism), side by
# side in one run. docs/plan.md quotes its table.
#
#   bash bench/plan_validate.sh            # 2 ranks of 1 thread
#   STEPS=8 bash bench/plan_validate.sh    # more steps a layout (median of all but the first)
#
# What is calibrated, and on what (loom plan --calibrate, before any layout
# runs): the sgemm peak and efficiency curve (sgemms at the model's
# shapes), memory bandwidth (a copy), the elementwise rate (one block of
# the model, forward and backward, in one process at its micro-batch), and
# the link between the two ranks (ping-pong). Nothing below is fitted to
# the layouts it predicts.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
LOOM=${LOOM:-build/apps/loom/loom}
STEPS=${STEPS:-6}
CONFIG=${CONFIG:-configs/bench/gpt-s.json}
WORK=$(mktemp -d /tmp/loom-plan-validate.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
MPI=(mpirun --oversubscribe --bind-to none -np 2)

echo "== $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(getconf _NPROCESSORS_ONLN) cores, 2 ranks x 1 thread, $CONFIG"
"${MPI[@]}" "$LOOM" plan --calibrate "$WORK/here.json" --model "$CONFIG" | tail -1

dense=(
  tp=1,pp=1,zero=0,recompute=none
  tp=1,pp=1,zero=1,recompute=none
  tp=1,pp=1,zero=2,recompute=none
  tp=1,pp=1,zero=3,recompute=none
  tp=1,pp=1,zero=0,recompute=selective
  tp=1,pp=1,zero=0,recompute=full
  tp=2,pp=1,zero=0,recompute=none,sp=false
  tp=2,pp=1,zero=0,recompute=none,sp=true
  tp=1,pp=2,micro=4,zero=0,schedule=1f1b
  tp=1,pp=2,micro=4,zero=0,schedule=gpipe
  tp=1,pp=2,micro=4,zero=0,schedule=interleaved,v=2
  tp=1,pp=2,micro=4,zero=0,schedule=zero_bubble
  tp=1,pp=1,zero=0,precision=bf16
  tp=1,pp=1,zero=1,precision=bf16,recompute=selective
)
moe=(
  tp=1,pp=1,zero=0,ep=1
  tp=1,pp=1,zero=0,ep=2
  tp=1,pp=1,zero=1,ep=2,recompute=selective
)
args=()
for l in "${dense[@]}"; do args+=(--layout "$l"); done
"${MPI[@]}" "$LOOM" tune --config "$CONFIG" --cluster "$WORK/here.json" --steps "$STEPS" \
  --out "$WORK/tuned.json" --json "$WORK/dense.jsonl" "${args[@]}" > "$WORK/dense.txt"
args=()
for l in "${moe[@]}"; do args+=(--layout "$l"); done
"${MPI[@]}" "$LOOM" tune --config "$CONFIG" --cluster "$WORK/here.json" --steps "$STEPS" \
  --set model.moe.num_experts=4 --set model.moe.top_k=2 --set model.moe.capacity_factor=1.25 \
  --out "$WORK/tuned-moe.json" --json "$WORK/moe.jsonl" "${args[@]}" > "$WORK/moe.txt"

python3 - "$WORK/dense.jsonl" "$WORK/moe.jsonl" <<'EOF'
import json, sys
rows = []
for path, tag in zip(sys.argv[1:], ["", "MoE 4 experts top-2, "]):
    for line in open(path):
        rows.append((tag, json.loads(line)))
print("| layout | predicted s | measured s | error | predicted MB | measured MB | error |")
print("|---|---|---|---|---|---|---|")
time_ok = mem_ok = n = 0
for tag, d in rows:
    l = d["layout"]
    name = f"{tag}tp {l['tp']} pp {l['pp']} dp {l['dp']} ep {l['ep']}, micro {l['micro']}, ZeRO {l['zero']}, {l['recompute']}"
    if l["sp"]: name += ", sp"
    if l["pp"] > 1: name += f", {l['schedule']}" + (f" v {l['v']}" if l["v"] > 1 else "")
    if l["precision"] != "f32": name += f", {l['precision']}"
    if not d["ran"]:
        print(f"| {name} | skipped: {d['skipped']} |")
        continue
    m = d["measured"]; e = d["error_pct"]; n += 1
    time_ok += abs(e["step_time"]) <= 20
    mem_ok += abs(e["mem"]) <= 5
    print(f"| {name} | {d['step_time_s']:.3f} | {m['step_time_s']:.3f} | {e['step_time']:+.1f}% "
          f"| {d['mem_bytes']['total'] / 1e6:.1f} | {m['mem_bytes']['total'] / 1e6:.1f} | {e['mem']:+.1f}% |")
errs_t = sorted(abs(d["error_pct"]["step_time"]) for _, d in rows if d["ran"])
errs_m = sorted(abs(d["error_pct"]["mem"]) for _, d in rows if d["ran"])
print(f"\n{n} layouts: step time within 20% for {time_ok} (median |error| {errs_t[len(errs_t)//2]:.1f}%, "
      f"max {errs_t[-1]:.1f}%), peak memory within 5% for {mem_ok} (median {errs_m[len(errs_m)//2]:.1f}%, "
      f"max {errs_m[-1]:.1f}%)")
EOF
