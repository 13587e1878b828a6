#!/usr/bin/env bash
# Across hosts, on the test cluster (scripts/cluster.sh: network namespaces
# on this machine, links limited with tc tbf), side by side in one run:
#  1. all-reduce bus bandwidth of mpi, ring, rhd, hierarchical (and what
#     auto picks) from 1 MiB to 256 MiB: 1 host x 4 ranks, then 2 hosts x 2
#     ranks over 1 Gbit/s and 10 Gbit/s links;
#  2. gpt-m data parallel on 2 hosts x 1 rank at 100 Mbit/s, 1 Gbit/s and
#     unlimited: step time and the exposed communication share;
#  3. tp 2 x dp 2 on 2 hosts x 2 ranks at 1 Gbit/s, the tensor-parallel
#     groups inside a host (comm.placement topology) against across hosts
#     (launcher order with --map-by node).
#
#   bench/hosts.sh                 (root; about 15 minutes on 2 cores)
#   SECTIONS="2 3" STEPS=6 MAX=64M bench/hosts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
loom=$(readlink -f "${LOOM:-build/apps/loom/loom}")
cluster=$(pwd)/scripts/cluster.sh
sections=${SECTIONS:-"1 2 3"} steps=${STEPS:-6} max=${MAX:-256M}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap '"$cluster" down; rm -rf "$work"' EXIT
echo "# $(lscpu | sed -n "s/^Model name: *//p"), $(getconf _NPROCESSORS_ONLN) cores ($(grep -o -w "amx_bf16\|avx512_bf16\|avx512f\|avx2" /proc/cpuinfo | sort -u | tr "\n" " ")); $(mpirun --version | head -1)"
"$cluster" up 2

busbw() {  # NAME MPIRUN...
  local name=$1
  shift
  "$@" "$loom" bench comm --algo mpi,ring,rhd,hierarchical,auto --min 1M --max "$max" \
    --iters 10 --warmup 2 --budget-s 6 --json > "$work/bw-$name.jsonl"
}
if [[ " $sections " == *" 1 "* ]]; then
  busbw one-host mpirun --oversubscribe --bind-to none -np 4 -x OMP_NUM_THREADS
  "$cluster" throttle 0 1gbit && "$cluster" throttle 1 1gbit
  busbw 1gbit "$cluster" mpirun --host node0:2,node1:2 -np 4 -x OMP_NUM_THREADS
  "$cluster" throttle 0 10gbit && "$cluster" throttle 1 10gbit
  busbw 10gbit "$cluster" mpirun --host node0:2,node1:2 -np 4 -x OMP_NUM_THREADS
  python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
for name, title in [("one-host", "1 host x 4 ranks (shared memory)"),
                    ("1gbit", "2 hosts x 2 ranks, 1 Gbit/s links"),
                    ("10gbit", "2 hosts x 2 ranks, 10 Gbit/s links")]:
    rows = [json.loads(l) for l in open(f"{work}/bw-{name}.jsonl")]
    sizes = sorted({r["bytes"] for r in rows})
    algos = ["mpi", "ring", "rhd", "hierarchical"]
    print(f"\n{title}: bus bandwidth GB/s (auto: its pick, and its bandwidth)\n")
    print("| size | " + " | ".join(algos) + " | auto |")
    print("|---|" + "---|" * (len(algos) + 1))
    for b in sizes:
        get = {r["algo"]: r for r in rows if r["bytes"] == b}
        best = max(algos, key=lambda a: get[a]["busbw"])
        cells = [("**%.3f**" if a == best else "%.3f") % get[a]["busbw"] for a in algos]
        print("| %s | %s | %s %.3f |" % (f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB",
              " | ".join(cells), get["auto"]["chosen"], get["auto"]["busbw"]))
PY
fi

train() {  # NAME CONFIG MPIRUN-ARGS... -- TRAIN-ARGS...
  local name=$1 cfg=$2
  shift 2
  local m=()
  while [[ $1 != -- ]]; do m+=("$1"); shift; done
  shift
  "$cluster" mpirun "${m[@]}" -x OMP_NUM_THREADS "$loom" train --config "$cfg" \
    --set train.steps="$steps" --set log.peak_gflops=100 --out "$work/$name" "$@" \
    > "$work/$name.txt" 2>&1 || { cat "$work/$name.txt"; exit 1; }
}
summary() {  # TITLE NAME...
  python3 - "$work" "$@" <<'PY'
import json, statistics as S, sys
work, title, names = sys.argv[1], sys.argv[2], sys.argv[3:]
print(f"\n{title}\n")
print("| run | step (s, median of steps 2..) | comm exposed (s) | exposed share | comm (s) | sent per step (MB) |")
print("|---|---|---|---|---|---|")
for n in names:
    m = [json.loads(l) for l in open(f"{work}/{n}/metrics.jsonl")][1:]
    step = S.median(r["time"]["step"] for r in m)
    exp = S.median(r["time"]["comm_exposed"] for r in m)
    comm = S.median(r["time"]["comm"] for r in m)
    sent = S.median(r["comm_bytes"] for r in m) / 1e6
    print(f"| {n} | {step:.3f} | {exp:.3f} | {100 * exp / step:.0f}% | {comm:.3f} | {sent:.1f} |")
PY
}
if [[ " $sections " == *" 2 "* ]]; then
  for rate in 100mbit 1gbit none; do
    "$cluster" throttle 0 "$rate" && "$cluster" throttle 1 "$rate"
    train "dp-$rate" configs/bench/gpt-m.json --host node0:1,node1:1 -np 2 --
  done
  summary "gpt-m, dp 2 on 2 hosts x 1 rank (ZeRO 0, overlapped buckets)" dp-100mbit dp-1gbit dp-none
fi
if [[ " $sections " == *" 3 "* ]]; then
  "$cluster" throttle 0 1gbit && "$cluster" throttle 1 1gbit
  train tp-inside configs/bench/gpt-m.json --host node0:2,node1:2 -np 4 --map-by node -- \
    --set parallel.tensor=2
  train tp-across configs/bench/gpt-m.json --host node0:2,node1:2 -np 4 --map-by node -- \
    --set parallel.tensor=2 --set comm.placement=launcher
  grep -h "loom: hosts\|warning: .*tensor-parallel" "$work/tp-inside.txt" "$work/tp-across.txt"
  summary "gpt-m, tp 2 x dp 2 on 2 hosts x 2 ranks at 1 Gbit/s (ranks dealt round-robin)" tp-inside tp-across
fi
# The GEMM path the training runs took (beside every figure).
cat "$work"/*.txt 2> /dev/null | grep -m1 "loom: GEMM" || true
