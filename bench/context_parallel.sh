#!/usr/bin/env bash
# Context parallelism, side by side in one run:
#  1. activation memory per rank against sequence length (4K to 64K tokens,
#     a one-block GPT, micro-batch 1) at cp 1, 2, 4, beside the records'
#     formula; and one activation budget (activation_checkpointing budget)
#     that a 64K sequence cannot train in at cp 1 and trains in at cp 4;
#  2. step time of p2p, all_gather and a2a at cp 2 and 4 (8K tokens, two
#     blocks), on one host and across two hosts of the test cluster
#     (scripts/cluster.sh, 1 Gbit/s links), and the share of the keys' and
#     values' communication that ran beside the attention;
#  3. the causal balance: each rank's seconds in the attention kernels with
#     the 2 x cp chunk order and with contiguous pieces (cp 2 and 4).
#
#   bench/context_parallel.sh                  (root for section 2; about 15 minutes on 2 cores)
#   SECTIONS="1 3" MAXLEN=32768 bench/context_parallel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
loom=$(readlink -f "${LOOM:-build/apps/loom/loom}")
cluster=$(pwd)/scripts/cluster.sh
sections=${SECTIONS:-"1 2 3"} maxlen=${MAXLEN:-65536} steps=${STEPS:-4}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
cluster_up=0
trap '((cluster_up)) && "$cluster" down; rm -rf "$work"' EXIT
echo "# $(lscpu | sed -n "s/^Model name: *//p"), $(getconf _NPROCESSORS_ONLN) cores ($(grep -o -w "amx_bf16\|avx512_bf16\|avx512f\|avx2" /proc/cpuinfo | sort -u | tr "\n" " ")); $(mpirun --version | head -1)"

# NAME RANKS JSON-MODEL SETS... : one run on this host.
run() {
  local name=$1 np=$2 model=$3
  shift 3
  cat > "$work/$name.json" << EOF
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
 "model": $model, "data": {"synthetic": true}, "train": {"steps": $steps},
 "log": {"peak_gflops": 100}}
EOF
  local sets=()
  for s in "$@"; do sets+=(--set "$s"); done
  mpirun --oversubscribe --bind-to none -np "$np" -x OMP_NUM_THREADS "$loom" train \
    --config "$work/$name.json" --out "$work/$name" "${sets[@]}" > "$work/$name.txt" 2>&1
}

if [[ " $sections " == *" 1 "* ]]; then
  lens=()
  for ((T = 4096; T <= maxlen; T *= 2)); do lens+=("$T"); done
  for T in "${lens[@]}"; do
    model="{\"n_layer\": 1, \"n_embd\": 64, \"n_head\": 4, \"vocab_size\": 256, \"seq_len\": $T}"
    for cp in 1 2 4; do
      steps=1 run "mem-$T-$cp" "$cp" "$model" "parallel.context=$cp" ||
        { cat "$work/mem-$T-$cp.txt"; exit 1; }
    done
  done
  # The budget: what cp 4 needs at the longest length, and a tenth more.
  T=${lens[-1]}
  budget=$(python3 -c "import json; m=[json.loads(l) for l in open('$work/mem-$T-4/metrics.jsonl')]; print(int(m[0]['mem']['activations'] * 1.1))")
  model="{\"n_layer\": 1, \"n_embd\": 64, \"n_head\": 4, \"vocab_size\": 256, \"seq_len\": $T}"
  for cp in 1 4; do
    steps=1 run "budget-$cp" "$cp" "$model" "parallel.context=$cp" \
      "activation_checkpointing.policy=budget" "activation_checkpointing.budget_bytes=$budget" ||
      true
  done
  python3 - "$work" "$budget" "$T" "${lens[@]}" << 'PY'
import json, os, sys
work, budget, T_max, lens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(x) for x in sys.argv[4:]]
C, NH, L, Vp = 64, 4, 1, 256
print("\n## Activation memory per rank (one block, n_embd 64, 4 heads, micro-batch 1)\n")
print("Formula, per rank: B x T/cp tokens x 4 bytes x [L (16 C + NH + 4) (the block's records:")
print("LayerNorms 2(C + 2), q|k|v 3C, output C, log-sum-exp NH, residuals 2C, MLP 8C) + the")
print("embedding's output C + ln_f's C + 2 + the logits Vp (their gradient computed in place) + the")
print("loss and its log-sum-exp 2]; nothing of size T^2 (the attention keeps its output and lse).\n")
print("| seq_len | cp 1 (MB) | cp 2 (MB) | cp 4 (MB) | formula cp 1/2/4 (MB) | measured / formula | cp 1 / cp 4 |")
print("|---|---|---|---|---|---|---|")
per_token = 4 * (L * (16 * C + NH + 4) + C + C + 2 + Vp + 2)
for T in lens:
    got = {}
    for cp in (1, 2, 4):
        m = [json.loads(l) for l in open(f"{work}/mem-{T}-{cp}/metrics.jsonl")]
        got[cp] = m[0]["mem"]["activations"] / 1e6
    f = [T // cp * per_token / 1e6 for cp in (1, 2, 4)]
    ratio = max(got[cp] / (f[k]) for k, cp in enumerate((1, 2, 4)))
    print(f"| {T} | {got[1]:.1f} | {got[2]:.1f} | {got[4]:.1f} | {f[0]:.1f} / {f[1]:.1f} / {f[2]:.1f} | {ratio:.3f} | {got[1] / got[4]:.2f} |")
print(f"\nOne activation budget of {budget / 1e6:.1f} MB per rank (activation_checkpointing.policy budget), seq_len {T_max}:\n")
for cp in (1, 4):
    txt = open(f"{work}/budget-{cp}.txt").read()
    path = f"{work}/budget-{cp}/metrics.jsonl"
    if os.path.exists(path) and os.path.getsize(path) > 0:
        m = [json.loads(l) for l in open(path)]
        print(f"- cp {cp}: trains, activations {m[0]['mem']['activations'] / 1e6:.1f} MB, loss {m[0]['loss']:.4f}")
    else:
        err = [l for l in txt.splitlines() if "budget_bytes" in l and "error" in l.lower()]
        print(f"- cp {cp}: refused: {(err or txt.strip().splitlines()[-1:])[0].strip()}")
PY
fi

if [[ " $sections " == *" 2 "* ]]; then
  model='{"n_layer": 2, "n_embd": 128, "n_head": 8, "vocab_size": 256, "seq_len": 8192}'
  for cp in 2 4; do
    for comm in p2p all_gather a2a; do
      run "one-$cp-$comm" "$cp" "$model" "parallel.context=$cp" "parallel.context_comm=$comm" ||
        { cat "$work/one-$cp-$comm.txt"; exit 1; }
    done
  done
  "$cluster" up 2 --bandwidth 1gbit
  cluster_up=1
  for cp in 2 4; do
    for comm in p2p all_gather a2a; do
      name="hosts-$cp-$comm"
      cat > "$work/$name.json" << EOF
{"train_micro_batch_size_per_gpu": 1, "model": $model, "data": {"synthetic": true},
 "train": {"steps": $steps}, "log": {"peak_gflops": 100}}
EOF
      "$cluster" mpirun --host "node0:$((cp / 2)),node1:$((cp / 2))" -np "$cp" --bind-to none \
        -x OMP_NUM_THREADS \
        "$loom" train --config "$work/$name.json" --out "$work/$name" \
        --set parallel.context=$cp --set parallel.context_comm=$comm > "$work/$name.txt" 2>&1 ||
        { cat "$work/$name.txt"; exit 1; }
    done
  done
  python3 - "$work" << 'PY'
import json, statistics as S, sys
work = sys.argv[1]
print("\n## Step time by context_comm (8K tokens, two blocks, n_embd 128, 8 heads, micro-batch 1)\n")
print("Medians of steps 2.., rank 0. In flight: seconds the keys' and values' collectives were")
print("under way (the ring's run beside the attention); exposed: the part waited for. all_gather")
print("moves the ring's bytes (cp - 1 chunk pairs a rank, forward and backward) and waits for all")
print("of them: hidden = 1 - p2p's exposed / all_gather's exposed (the ring sends (3cp - 2) n")
print("a rank a layer against all_gather's 3 (cp - 1) n: the figure errs low).\n")
print("| placement | cp | context_comm | step (s) | vs p2p | in flight (s) | exposed (s) | hidden |")
print("|---|---|---|---|---|---|---|---|")
for place, title in (("one", "1 host"), ("hosts", "2 hosts, 1 Gbit/s")):
    for cp in (2, 4):
        rows = {}
        for comm in ("p2p", "all_gather", "a2a"):
            m = [json.loads(l) for l in open(f"{work}/{place}-{cp}-{comm}/metrics.jsonl")][1:]
            rows[comm] = (S.median(r["time"]["step"] for r in m),
                          S.median(r["context"]["comm"] for r in m),
                          S.median(r["context"]["exposed"] for r in m))
        base, gather = rows["p2p"][0], rows["all_gather"][2]
        for comm, (step, c, e) in rows.items():
            hidden = f"{1 - e / gather:.0%}" if comm == "p2p" and gather > 0 else ""
            print(f"| {title} | {cp} | {comm} | {step:.3f} | {step / base:.2f} | {c:.3f} | {e:.3f} | {hidden} |")
PY
fi

if [[ " $sections " == *" 3 "* ]]; then
  model='{"n_layer": 2, "n_embd": 128, "n_head": 8, "vocab_size": 256, "seq_len": 8192}'
  for cp in 2 4; do
    for bal in true false; do
      run "bal-$cp-$bal" "$cp" "$model" "parallel.context=$cp" "parallel.context_balance=$bal" ||
        { cat "$work/bal-$cp-$bal.txt"; exit 1; }
    done
  done
  python3 - "$work" << 'PY'
import json, statistics as S, sys
work = sys.argv[1]
print("\n## Causal balance: seconds in the attention kernels per rank (median of steps 2..)\n")
print("| cp | chunks | per rank (s) | slowest / fastest | expected by the causal work |")
print("|---|---|---|---|---|")
for cp in (2, 4):
    for bal in ("true", "false"):
        m = [json.loads(l) for l in open(f"{work}/bal-{cp}-{bal}/metrics.jsonl")][1:]
        per = [S.median(r["context"]["attention"][k] for r in m) for k in range(cp)]
        # Key-query pairs each rank's queries see: chunk c (of 2cp) sees c + 1/2 chunks' worth.
        if bal == "true":
            work_ = [(r + 0.5) + (2 * cp - 1 - r + 0.5) for r in range(cp)]
        else:
            work_ = [(2 * r + 0.5) + (2 * r + 1 + 0.5) for r in range(cp)]
        name = "r, 2cp - 1 - r" if bal == "true" else "2r, 2r + 1 (contiguous)"
        print(f"| {cp} | {name} | {' / '.join(f'{x:.3f}' for x in per)} | {max(per) / min(per):.2f} | {max(work_) / min(work_):.2f} |")
PY
fi
# The GEMM path every run took (the first run's log says it).
grep -h -m1 "^loom: GEMM" "$work"/*.txt | head -1 | sed 's/^loom: /# /'
