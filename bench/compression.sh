#!/usr/bin/env bash
# Gradient compression, side by side in one run, each figure against AdamW's
# plain f32 all-reduce measured in the same section:
#  1. bytes on the wire per step for gpt-m, dp 2 on one host: the 1-bit
#     phase of OneBitAdam and ZeroOneAdam (and 0/1 Adam's local steps),
#     PowerSGD at rank 1, 4 and 16, fp16 compression (comm_bytes of
#     metrics.jsonl: the record of every collective, and the dp group's
#     share); under ZeRO, OneBitAdam at stage 1 and PowerSGD at stage 2
#     against AdamW at the same stage;
#  2. convergence on the demo data (configs/demo.json, 600 steps) at dp 2
#     and dp 4: final training loss (mean of the last 20 steps) and
#     validation loss of OneBitAdam (warm-up 20%), ZeroOneAdam and PowerSGD
#     rank 4 and 16 against AdamW with the same seeds, and the curves
#     (docs/compression-dp<N>.svg);
#  3. across hosts (scripts/cluster.sh, 2 hosts x 1 rank) at 100 Mbit/s and
#     1 Gbit/s: gpt-m's step time in the compressed phase against AdamW's,
#     and the exposed communication share.
#
#   bench/compression.sh                      (root for section 3; about 40 minutes on 2 cores)
#   SECTIONS="1 3" STEPS=6 bench/compression.sh
set -euo pipefail
cd "$(dirname "$0")/.."
loom=$(readlink -f "${LOOM:-build/apps/loom/loom}")
cluster=$(pwd)/scripts/cluster.sh
sections=${SECTIONS:-"1 2 3"} steps=${STEPS:-6} demo_steps=${DEMO_STEPS:-600}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap '"$cluster" down 2> /dev/null || true; rm -rf "$work"' EXIT
echo "# $(lscpu | sed -n "s/^Model name: *//p"), $(getconf _NPROCESSORS_ONLN) cores ($(grep -o -w "amx_bf16\|avx512_bf16\|avx512f\|avx2" /proc/cpuinfo | sort -u | tr "\n" " ")); $(mpirun --version | head -1)"

# Each compressor from its first compressed step on (steps 2..: the first
# step is uncompressed for all of them).
declare -A how=(
  [adamw]=""
  [onebit]="--set optimizer.type=OneBitAdam --set optimizer.params.freeze_step=1"
  [zeroone]="--set optimizer.type=ZeroOneAdam --set optimizer.params.var_freeze_step=1"
  [powersgd-1]="--set comm.compression.type=powersgd --set comm.compression.rank=1 --set comm.compression.start_iter=1"
  [powersgd-4]="--set comm.compression.type=powersgd --set comm.compression.rank=4 --set comm.compression.start_iter=1"
  [powersgd-16]="--set comm.compression.type=powersgd --set comm.compression.rank=16 --set comm.compression.start_iter=1"
  [fp16]="--set comm.compression.type=fp16"
  # 0/1 Adam's local steps: intervals 1, 2, then 4 from step 4 (a step in
  # four sends); twice the steps, so that the mean covers whole intervals.
  [zeroone-local]="--set optimizer.type=ZeroOneAdam --set optimizer.params.var_freeze_step=1 --set optimizer.params.local_step_scaler=1 --set optimizer.params.local_step_clipper=4"
  # Under ZeRO: 1-bit Adam at stage 1, PowerSGD at stage 2, against AdamW at the same stage.
  [adamw-zero1]="--set zero_optimization.stage=1"
  [onebit-zero1]="--set optimizer.type=OneBitAdam --set optimizer.params.freeze_step=1 --set zero_optimization.stage=1"
  [adamw-zero2]="--set zero_optimization.stage=2"
  [powersgd-4-zero2]="--set comm.compression.type=powersgd --set comm.compression.rank=4 --set comm.compression.start_iter=1 --set zero_optimization.stage=2"
)
# Steps per run: the local-step row runs twice as many.
steps_of() { [[ $1 == *zeroone-local ]] && echo $((2 * steps)) || echo "$steps"; }

table() {  # TITLE NAME...
  python3 - "$work" "$@" <<'PY'
import json, statistics as S, sys
work, title, names = sys.argv[1], sys.argv[2], sys.argv[3:]
print(f"\n{title}\n")
print("| run | step (s) | mean step (s) | comm exposed (s) | exposed share | sent per step (MB) | mean sent (MB) | dp group (MB) | vs the first row's bytes | compression ratio (metrics) |")
print("|---|---|---|---|---|---|---|---|---|---|")
base = None
for n in names:
    m = [json.loads(l) for l in open(f"{work}/{n}/metrics.jsonl")][2:]  # compressed steps
    step = S.median(r["time"]["step"] for r in m)
    mstep = S.mean(r["time"]["step"] for r in m)
    exp = S.median(r["time"]["comm_exposed"] for r in m)
    sent = S.median(r["comm_bytes"] for r in m)
    msent = S.mean(r["comm_bytes"] for r in m)
    dp = S.median(sum(g["bytes"] for k, g in r.get("comm_groups", {}).items() if k in ("dp", "world")) for r in m)
    base = base or msent
    ratios = sorted(r["compression"]["ratio"] for r in m
                    if r.get("compression", {}).get("ratio") is not None)
    phases = sorted({r["compression"]["phase"] for r in m if "compression" in r})
    ratio = f"{ratios[len(ratios) // 2]:.1f}x ({', '.join(phases)})" if ratios else "-"
    print(f"| {n} | {step:.3f} | {mstep:.3f} | {exp:.3f} | {100 * exp / step:.0f}% | {sent / 1e6:.2f} | {msent / 1e6:.2f} | {dp / 1e6:.2f} | {base / msent:.1f}x fewer | {ratio} |")
PY
}

run() {  # NAME CONFIG LAUNCH... -- ARGS...
  local name=$1 cfg=$2
  shift 2
  local m=()
  while [[ $1 != -- ]]; do m+=("$1"); shift; done
  shift
  "${m[@]}" -x OMP_NUM_THREADS "$loom" train --config "$cfg" --set log.peak_gflops=100 \
    --out "$work/$name" "$@" > "$work/$name.txt" 2>&1 || { cat "$work/$name.txt"; exit 1; }
}

if [[ " $sections " == *" 1 "* ]]; then
  for group in "adamw onebit zeroone zeroone-local powersgd-1 powersgd-4 powersgd-16 fp16" \
    "adamw-zero1 onebit-zero1" "adamw-zero2 powersgd-4-zero2"; do
    names=()
    for c in $group; do
      # shellcheck disable=SC2086
      run "bytes-$c" configs/bench/gpt-m.json mpirun --oversubscribe --bind-to none -np 2 -- \
        --set train.steps="$(steps_of "$c")" ${how[$c]}
      names+=("bytes-$c")
    done
    table "gpt-m, dp 2 on one host, the compressed steps (3..)" "${names[@]}"
  done
fi

if [[ " $sections " == *" 2 "* ]]; then
  [[ -f data/fortunes/meta.json ]] || { echo "run scripts/demo.sh once: it prepares data/fortunes" >&2; exit 1; }
  warm=$((demo_steps / 5))
  declare -A conv=(
    [adamw]=""
    [onebit]="--set optimizer.type=OneBitAdam --set optimizer.params.freeze_step=$warm"
    [zeroone]="--set optimizer.type=ZeroOneAdam"
    [powersgd-4]="--set comm.compression.type=powersgd --set comm.compression.rank=4"
    [powersgd-16]="--set comm.compression.type=powersgd --set comm.compression.rank=16"
    # 0/1 Adam frozen after the warm-up (20%), local steps after another
    # tenth of the run: intervals 2, 4, 8, then 16, each for a tenth.
    [zeroone-local]="--set optimizer.type=ZeroOneAdam --set optimizer.params.var_freeze_step=$warm --set optimizer.params.local_step_scaler=$((demo_steps / 10))"
  )
  # CONV="adamw zeroone-local" runs those alone (the curves need them all).
  conv_runs=${CONV:-"adamw onebit zeroone powersgd-4 powersgd-16 zeroone-local"}
  for np in 2 4; do
    for c in $conv_runs; do
      # shellcheck disable=SC2086
      run "conv$np-$c" configs/demo.json mpirun --oversubscribe --bind-to none -np "$np" -- \
        --set train.steps="$demo_steps" --set scheduler.params.total_num_steps="$demo_steps" \
        --set train_micro_batch_size_per_gpu=$((16 / np)) --set checkpoint.every=0 ${conv[$c]}
    done
  done
  python3 - "$work" "$demo_steps" "$conv_runs" <<'PY'
import json, sys
work, steps, wanted = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
colors = {"adamw": "#222", "onebit": "#d62728", "zeroone": "#1f77b4", "powersgd-4": "#2ca02c",
          "powersgd-16": "#9467bd", "zeroone-local": "#ff7f0e"}
curves = all(c in wanted for c in colors)
colors = {c: v for c, v in colors.items() if c in wanted}
for np in (2, 4):
    runs = {c: [json.loads(l) for l in open(f"{work}/conv{np}-{c}/metrics.jsonl")] for c in colors}
    print(f"\ndemo data, {steps} steps, dp {np}: final loss (mean of the last 20 steps) and validation loss\n")
    print("| optimizer | final loss | vs AdamW | val loss | vs AdamW | compressed steps | median ratio |")
    print("|---|---|---|---|---|---|---|")
    base_f = base_v = None
    for c, m in runs.items():
        f = sum(r["loss"] for r in m[-20:]) / 20
        v = [r["val_loss"] for r in m if "val_loss" in r][-1]
        base_f, base_v = base_f or f, base_v or v
        comp = [r["compression"] for r in m if r.get("compression", {}).get("phase") in ("compressed", "local")]
        comp = [x for x in comp if x["ratio"] is not None] + [x for x in comp if x["ratio"] is None]
        sent = sorted(x["ratio"] for x in comp if x["ratio"] is not None)
        ratio = sent[len(sent) // 2] if sent else 1
        print(f"| {c} | {f:.4f} | {100 * (f / base_f - 1):+.2f}% | {v:.4f} | {100 * (v / base_v - 1):+.2f}% | {len(comp)} | {ratio:.1f}x |")
    if not curves:
        continue
    # The curves: training loss (a 20-step moving mean), one line per optimizer.
    W, H, L, B = 640, 360, 50, 30
    lo = min(min(r["loss"] for r in m[20:]) for m in runs.values())
    hi = max(max(r["loss"] for r in m[20:]) for m in runs.values())
    x = lambda s: L + (W - L - 10) * (s - 1) / (steps - 1)
    y = lambda v: 10 + (H - B - 10) * (hi - v) / (hi - lo)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="{H - 8}">training loss (20-step mean) against step, demo data, dp {np}</text>']
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        out.append(f'<line x1="{L}" x2="{W - 10}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="4" y="{y(v) + 4:.1f}">{v:.2f}</text>')
    for i, (c, m) in enumerate(runs.items()):
        pts = []
        for j in range(19, len(m)):
            mean = sum(r["loss"] for r in m[j - 19:j + 1]) / 20
            pts.append(f"{x(m[j]['step']):.1f},{y(mean):.1f}")
        out.append(f'<polyline fill="none" stroke="{colors[c]}" stroke-width="1.5" points="{" ".join(pts)}"/>')
        out.append(f'<text x="{W - 130}" y="{24 + 16 * i}" fill="{colors[c]}">{c}</text>')
    out.append("</svg>")
    open(f"docs/compression-dp{np}.svg", "w").write("\n".join(out) + "\n")
PY
fi

if [[ " $sections " == *" 3 "* ]]; then
  "$cluster" up 2
  for rate in 100mbit 1gbit; do
    "$cluster" throttle 0 "$rate" && "$cluster" throttle 1 "$rate"
    names=()
    for c in adamw onebit zeroone-local powersgd-4 fp16 onebit-zero1; do
      # shellcheck disable=SC2086
      # --bind-to none: each host's rank may use any core (mpirun would bind
      # both to core 0, the hosts being namespaces of one machine).
      run "hosts-$rate-$c" configs/bench/gpt-m.json "$cluster" mpirun --host node0:1,node1:1 -np 2 \
        --bind-to none -- \
        --set train.steps="$(steps_of "$c")" ${how[$c]}
      names+=("hosts-$rate-$c")
    done
    table "gpt-m, dp 2 on 2 hosts x 1 rank at $rate, the compressed steps (3..)" "${names[@]}"
  done
fi
# The GEMM path the training runs took (beside every figure).
cat "$work"/*.txt 2> /dev/null | grep -m1 "loom: GEMM" || true
