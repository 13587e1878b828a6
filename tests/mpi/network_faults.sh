#!/usr/bin/env bash
# Network faults across the hosts of the test cluster (the link cut is
# tests/mpi/partition.sh; restarts are tests/mpi/launch.sh):
#  - a link throttled to a tenth of its bandwidth mid-run (1 Gbit/s ->
#    100 Mbit/s) only slows the run: the losses are those of a run at full
#    bandwidth, bit for bit;
#  - a host killed mid-run (every process on it): the job ends non-zero
#    within 30 s, loom launch (no restarts) names the host, and nothing is
#    left running on either host.
# Needs root, network namespaces and tc; exits 77 (skipped) where they are
# not available.
set -euo pipefail
LOOM=${LOOM:?}
source "$(dirname "$0")/cluster_lib.sh"
cluster_up 2 --bandwidth 1gbit
cat > "$WORK/train.json" <<JSON
{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
 "model": {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 256, "seq_len": 64},
 "data": {"synthetic": true}, "train": {"steps": 30},
 "log": {"peak_gflops": 100, "every": 1}, "comm": {"timeout_s": 30}}
JSON
# run NAME HOSTS NP [TRAIN-ARGS...]: trains in the background; sets job.
run() {
  timeout -k 5 200 "$CLUSTER" mpirun --host "$2" -np "$3" -x OMP_NUM_THREADS "$LOOM" train \
    --config "$WORK/train.json" --out "$WORK/$1" "${@:4}" > "$WORK/$1.txt" 2>&1 &
  job=$!
  JOBS+=("$job")
}
median_step_s() {
  python3 -c 'import json,statistics,sys
lo, hi = int(sys.argv[2]), int(sys.argv[3])
t = [json.loads(l)["time"]["step"] for l in open(sys.argv[1]) if lo <= json.loads(l)["step"] <= hi]
print("%.4f" % statistics.median(t))' "$WORK/$1/metrics.jsonl" "$2" "$3"
}

# Throttled mid-run: dp 2, one rank per host (every gradient byte crosses the link).
run full node0:1,node1:1 2
wait "$job" || fail "full bandwidth run: $(cat "$WORK/full.txt")"
run slow node0:1,node1:1 2
until_within 60 grep -aq "step 10/" "$WORK/slow.txt" || fail "throttle: no step 10: $(cat "$WORK/slow.txt")"
"$CLUSTER" throttle 1 100mbit
wait "$job" || fail "throttled run: $(cat "$WORK/slow.txt")"
diff <(losses "$WORK/full") <(losses "$WORK/slow") > /dev/null ||
  fail "throttled: losses differ: $(diff <(losses "$WORK/full") <(losses "$WORK/slow") | head)"
echo "ok: throttled to 100 Mbit/s at step ~10: losses bitwise as at 1 Gbit/s; median step" \
  "$(median_step_s full 20 30) s at 1 Gbit/s, $(median_step_s slow 20 30) s throttled (steps 20-30)"
"$CLUSTER" throttle 1 1gbit

# A killed host: 2 hosts x 2 ranks, every process of host 1 killed, under
# loom launch without restarts (it names the host whatever mpirun says).
timeout -k 5 200 "$CLUSTER" exec 0 "$LOOM" launch --hosts node0:2,node1:2 \
  --mpirun-args "$("$CLUSTER" mpirun-args) -x OMP_NUM_THREADS" -- train --config "$WORK/train.json" \
  --out "$WORK/kill" --set train.steps=2000 > "$WORK/kill.txt" 2>&1 &
job=$!
JOBS+=("$job")
until_within 60 grep -aq "step 5/" "$WORK/kill.txt" || fail "kill: no step 5: $(cat "$WORK/kill.txt")"
t0=$SECONDS
"$CLUSTER" kill 1
rc=0
until_within 30 bash -c "! kill -0 $job 2> /dev/null" || fail "kill: the job still running 30 s after"
wait "$job" || rc=$?
took=$((SECONDS - t0))
((rc != 0)) || fail "kill: the job exited 0"
grep -aqE "loom launch: the job failed: .*\(host node1\)" "$WORK/kill.txt" ||
  fail "kill: node1 not named: $(cat "$WORK/kill.txt")"
grep -aq "loom launch: no restarts left (--max-restarts 0)" "$WORK/kill.txt" || fail "kill: no final word"
until_within 10 test "$(in_hosts)" -eq 0 || fail "kill: processes left in the hosts"
echo "ok: host 1 killed: the job ended (exit $rc) after ${took} s: $(grep -a -m1 'loom launch: the job failed' "$WORK/kill.txt")"
echo PASS
