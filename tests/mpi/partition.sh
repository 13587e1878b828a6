#!/usr/bin/env bash
# A partitioned host: dp 4 over two hosts of the test cluster
# (scripts/cluster.sh: network namespaces with their own TCP stacks, Open
# MPI over TCP between them), the link of host 1 taken down mid-run.
#  A. With the launcher told to notice a lost host (Open MPI's out-of-band
#     TCP keepalive, shorter than comm.timeout_s, as scripts/cluster.sh and
#     docs/comm.md set it): mpirun exits non-zero within comm.timeout_s +
#     30 s, with no rank and no daemon left on either host.
#  B. Without it: mpirun cannot reach the cut-off daemon, but no rank
#     outlives the failure: every rank on both sides times out and ends
#     itself within comm.timeout_s + 30 s. (mpirun itself ends once the link
#     is back.)
# Needs root and network namespaces; exits 77 (skipped) where they are not
# available.
set -euo pipefail
LOOM=${LOOM:?}
source "$(dirname "$0")/cluster_lib.sh"
cluster_up 2

TIMEOUT=10
cat > "$WORK/train.json" <<JSON
{"train_batch_size": 8, "model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32},
 "data": {"synthetic": true}, "train": {"steps": 20000}, "comm": {"timeout_s": $TIMEOUT},
 "log": {"peak_gflops": 100, "every": 100000}}
JSON
hosts=(--host node0:2,node1:2 -np 4 -x OMP_NUM_THREADS)
# loom processes of run $1 (not the launcher's, whose command line names it too).
ranks_left() { pgrep -f -- "--out $WORK/$1" | xargs -r ps -o pid=,comm= -p | grep -c ' loom$' || true; }
# start NAME MPIRUN-OPTIONS...: trains across both hosts; waits for step 2.
start() {
  local name=$1
  shift
  # (timeout: nothing outlives the test, whatever happens)
  timeout -k 5 150 "$CLUSTER" mpirun "$@" "${hosts[@]}" "$LOOM" train --config "$WORK/train.json" \
    --out "$WORK/$name" > "$WORK/$name.txt" 2>&1 &
  job=$!
  JOBS+=("$job")
  for _ in $(seq 1 120); do
    grep -q "step 2/" "$WORK/$name.txt" 2> /dev/null && return
    kill -0 "$job" 2> /dev/null || fail "$name: the job ended before training: $(cat "$WORK/$name.txt")"
    sleep 0.5
  done
  fail "$name: no step 2 within 60 s: $(cat "$WORK/$name.txt")"
}

# 0. Across hosts, a rank that throws (on host 1, mid-backward with
# reductions in flight) still ends the job at once with its own message.
t0=$SECONDS
rc=0
LOOM_CLUSTER_KEEPALIVE="2 1 3" LOOM_TEST_THROW=backward:2:3 timeout -k 5 60 "$CLUSTER" mpirun "${hosts[@]}" -x LOOM_TEST_THROW \
  "$LOOM" train --config "$WORK/train.json" --out "$WORK/throw" > "$WORK/throw.txt" 2>&1 || rc=$?
took=$((SECONDS - t0))
((rc != 0 && rc != 124)) || fail "throw: exit $rc: $(cat "$WORK/throw.txt")"
((took <= 15)) || fail "throw: the job took $took s: $(cat "$WORK/throw.txt")"
first=$(grep -o -m1 "loom: rank [0-9]*: .*" "$WORK/throw.txt" || true)
[[ $first == "loom: rank 2: test fault: backward at step 3 (LOOM_TEST_THROW)" ]] ||
  fail "throw: first report is '$first': $(cat "$WORK/throw.txt")"
until_within 10 test "$(in_hosts)" -eq 0 || fail "throw: processes left in the hosts"
echo "ok: a rank on host 1 that throws ends the job in $took s (start to exit) with its message"

# A. Keepalive: 2 s idle, then 3 probes 1 s apart (the loss is noticed in
# about 5 s, before loom's own timeout of 10 s).
LOOM_CLUSTER_KEEPALIVE="2 1 3" start keepalive
t0=$SECONDS
"$CLUSTER" cut 1
while kill -0 "$job" 2> /dev/null; do
  ((SECONDS - t0 <= TIMEOUT + 30)) || fail "A: mpirun still running $((TIMEOUT + 30)) s after the cut"
  sleep 0.5
done
rc=0
wait "$job" || rc=$?
((rc != 0)) || fail "A: mpirun exited 0"
took=$((SECONDS - t0))
until_within 10 test "$(in_hosts)" -eq 0 ||
  fail "A: left running in the hosts: $(for h in loom-h0 loom-h1; do ip netns pids "$h"; done | xargs -r ps -o pid=,args= -p)"
first=$(grep -m1 -E "lost communication with a remote daemon|loom: rank [0-9]+:" "$WORK/keepalive.txt" || true)
echo "ok: A. partition with keepalive: mpirun exited $rc in $took s after the cut; first report: $first"
"$CLUSTER" heal 1

# B. No keepalive: every rank ends itself.
LOOM_CLUSTER_KEEPALIVE=off start plain
t0=$SECONDS
"$CLUSTER" cut 1
until [[ $(ranks_left plain) == 0 ]]; do
  ((SECONDS - t0 <= TIMEOUT + 30)) || fail "B: ranks still running $((TIMEOUT + 30)) s after the cut: $(pgrep -af -- "--out $WORK/plain")"
  sleep 0.5
done
took=$((SECONDS - t0))
grep -q "comm timeout: .* did not complete within comm.timeout_s = $TIMEOUT s; .*ranks that did not answer: 2 (world 2 on node1), 3 (world 3 on node1); unreachable host: node1" \
  "$WORK/plain.txt" || fail "B: no timeout report naming the cut-off ranks: $(cat "$WORK/plain.txt")"
echo "ok: B. partition without keepalive: no rank left $took s after the cut (the reachable side named ranks 2, 3)"
"$CLUSTER" heal 1
t0=$SECONDS
while kill -0 "$job" 2> /dev/null; do
  ((SECONDS - t0 <= 60)) || fail "B: mpirun still running 60 s after the link came back"
  sleep 0.5
done
rc=0
wait "$job" || rc=$?
((rc != 0)) || fail "B: mpirun exited 0"
echo "ok: B. mpirun exited $rc $((SECONDS - t0)) s after the link came back"
echo PASS
