#!/usr/bin/env bash
# 16-bit training against f32, three figures (docs/performance.md):
#   1. step time of configs/bench/gpt-m.json in one process, f32 / bf16 / fp16
#      (and the 16-bit ones with kernels.gemm_inputs: 16bit, and bf16 with
#      its activation records kept in f32) measured in alternating rounds,
#      with forward, backward and optimizer medians from metrics.jsonl and
#      the activations' peak bytes;
#   2. the demo model on the demo data (configs/demo.json) for STEPS_DEMO
#      steps in each precision (and bf16 with f32 records, and bf16 with
#      16-bit GEMM inputs where the CPU has a bf16 matmul): the loss every
#      50 steps, the largest relative
#      difference from f32 over a window of 10 steps, the final validation loss;
#   3. the DeepSpeed-style config configs/deepspeed-fp16.json on 2 ranks
#      (fp16, ZeRO-3, offload_optimizer cpu).
#
#   bench/mixed_precision.sh
#   ROUNDS=3 STEPS=8 STEPS_DEMO=300 SKIP_DEMO=1 bench/mixed_precision.sh
set -euo pipefail
cd "$(dirname "$0")/.."
loom=${LOOM:-build/apps/loom/loom}
rounds=${ROUNDS:-3} steps=${STEPS:-8} steps_demo=${STEPS_DEMO:-300}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
precisions="f32 bf16 fp16 bf16+f32rec bf16+gemm16"
# The step-time table also runs each 16-bit type with 16-bit GEMM inputs.
timed="f32 bf16 fp16 bf16+f32rec bf16+gemm16 fp16+gemm16"
# bf16 GEMM inputs need a bf16 matmul (AVX-512 and oneDNN): without one the
# rows that ask for them are left out.
if ! "$loom" bench gemm --sizes 64 --reps 1 --dtype f32,bf16 > /dev/null 2>&1; then
  precisions=${precisions/ bf16+gemm16/} timed=${timed/ bf16+gemm16/}
fi
flag() { [[ $1 == f32 ]] && echo "train.seed=1234" || echo "${1%%+*}.enabled=true"; }
gemm() { [[ $1 == *+gemm16 ]] && echo "kernels.gemm_inputs=16bit" || echo "kernels.gemm_inputs=f32"; }
rec() { [[ $1 == *+f32rec ]] && echo "activation_checkpointing.activation_dtype=f32" ||
  echo "activation_checkpointing.activation_dtype=auto"; }

echo "# machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
for ((r = 1; r <= rounds; r++)); do
  for p in $timed; do
    OMP_NUM_THREADS=$(nproc) "$loom" train --config configs/bench/gpt-m.json --set "$(flag "$p")" \
      --set "$(gemm "$p")" --set "$(rec "$p")" --set train.steps="$steps" --out "$work/m-$p-$r" \
      > "$work/m-$p-$r.txt" 2>&1 ||
      { cat "$work/m-$p-$r.txt"; exit 1; }
  done
done
grep -m1 "^loom: GEMM" "$work/m-f32-1.txt" || true

if [[ -z ${SKIP_DEMO:-} ]]; then
  [[ -f data/fortunes/train.bin ]] || { echo "data/fortunes: run scripts/demo.sh once first"; exit 1; }
  for p in $precisions; do
    OMP_NUM_THREADS=$(nproc) "$loom" train --config configs/demo.json --set "$(flag "$p")" \
      --set "$(gemm "$p")" --set "$(rec "$p")" --set train.steps="$steps_demo" --set train.eval_every="$steps_demo" \
      --set checkpoint.every=0 --set train.sample_tokens=0 --out "$work/d-$p" \
      > "$work/d-$p.txt" 2>&1 || { cat "$work/d-$p.txt"; exit 1; }
  done
fi

OMP_NUM_THREADS=1 mpirun --oversubscribe --bind-to none -np 2 "$loom" train \
  --config configs/deepspeed-fp16.json --set train.steps=30 --out "$work/ds" \
  > "$work/ds.txt" 2>&1 || { cat "$work/ds.txt"; exit 1; }

python3 - "$work" "$rounds" "$precisions" "${SKIP_DEMO:-}" "$timed" <<'PY'
import json, statistics as S, sys
work, rounds, precs, skip_demo, timed = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4], sys.argv[5].split()
load = lambda d: [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
print("\n## gpt-m step time (one process; first two steps left out)")
print("| precision | step s (median of rounds) | vs f32 | forward s | backward s | optimizer s | tokens/s | activations MB |")
print("|---|---|---|---|---|---|---|---|")
med = {}
for p in timed:
    rr = [load(f"{work}/m-{p}-{r}")[2:] for r in range(1, rounds + 1)]
    m = lambda k: S.median(S.median(x["time"][k] for x in run) for run in rr)
    med[p] = {k: m(k) for k in ("step", "forward", "backward", "optimizer")}
    med[p]["tps"] = S.median(S.median(x["tokens_per_s"] for x in run) for run in rr)
    med[p]["act"] = max(x["mem"]["activations"] for x in rr[0]) / 1e6
for p in timed:
    d = med[p]
    print(f"| {p} | {d['step']:.3f} | {d['step'] / med['f32']['step']:.2f}x | {d['forward']:.3f} | "
          f"{d['backward']:.3f} | {d['optimizer']:.3f} | {d['tps']:.0f} | {d['act']:.1f} |")
if not skip_demo:
    print("\n## demo model on the demo data: loss every 50 steps")
    runs = {p: load(f"{work}/d-{p}") for p in precs}
    n = len(runs["f32"])
    print("| step | " + " | ".join(precs) + " |")
    print("|---|" + "---|" * len(precs))
    for s in list(range(49, n, 50)):
        print(f"| {s + 1} | " + " | ".join(f"{runs[p][s]['loss']:.4f}" for p in precs) + " |")
    # A window mean takes out the step-to-step noise of one batch.
    win = lambda r, s: S.mean(x["loss"] for x in r[s:s + 10])
    for p in precs[1:]:
        worst = max(abs(win(runs[p], s) - win(runs["f32"], s)) / win(runs["f32"], s)
                    for s in range(0, n - 9))
        each = max(abs(runs[p][s]["loss"] - runs["f32"][s]["loss"]) / runs["f32"][s]["loss"]
                   for s in range(n))
        val = lambda r: [x["val_loss"] for x in r if "val_loss" in x][-1]
        print(f"{p}: largest relative difference from f32 of a 10-step mean {worst:.2e}, of one "
              f"step {each:.2e}; validation loss {val(runs[p]):.4f} vs f32 {val(runs['f32']):.4f}; "
              f"skipped steps {runs[p][-1]['skipped_steps']}")
ds = load(f"{work}/ds")
print("\n## configs/deepspeed-fp16.json on 2 ranks (fp16, ZeRO-3, 30 steps)")
print(f"loss {ds[0]['loss']:.4f} -> {ds[-1]['loss']:.4f}, median {S.median(x['tokens_per_s'] for x in ds[2:]):.0f} "
      f"tokens/s, loss scale {ds[-1]['loss_scale']:g}, skipped {ds[-1]['skipped_steps']}, "
      f"model state per rank {sum(ds[-1]['mem'][k] for k in ('params', 'grads', 'optimizer'))} bytes")
PY
