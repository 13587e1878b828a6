#!/usr/bin/env bash
# loom launch across the hosts of the test cluster (2 hosts x 2 ranks):
#  - bad input is refused before anything trains, with the reason;
#  - an uninterrupted run with a slow rank (LOOM_TEST_SLOW) names it as a
#    straggler, with its host; its losses are the reference;
#  - host 1 killed (every process on it) mid-run: the launcher names the
#    host, restarts on both hosts from the latest checkpoint, and the run
#    ends with the reference's losses bit for bit; metrics.jsonl marks the
#    restart;
#  - host 1's link cut mid-run: the launcher finds the host unreachable and
#    restarts on host 0 alone (dp 4 -> 2, accumulation 2 -> 4, the global
#    batch kept); the run continues bit for bit like `train --resume` from
#    that checkpoint at dp 2;
#  - SIGTERM to the launcher stops the job without a restart.
# Needs root and network namespaces; exits 77 (skipped) where they are not
# available.
set -euo pipefail
LOOM=${LOOM:?}
source "$(dirname "$0")/cluster_lib.sh"
cluster_up 2
ARGS="$("$CLUSTER" mpirun-args) -x OMP_NUM_THREADS -x LOOM_TEST_SLOW"
cat > "$WORK/train.json" <<JSON
{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
 "model": {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 256, "seq_len": 64},
 "data": {"synthetic": true}, "train": {"steps": 50}, "checkpoint": {"every": 10},
 "log": {"peak_gflops": 100, "every": 1}, "comm": {"timeout_s": 30}}
JSON
launch() { "$CLUSTER" exec 0 "$LOOM" launch "$@"; }
# expect_error TEXT ARGS...: loom launch fails at once with TEXT.
expect_error() {
  local want=$1 rc=0
  shift
  timeout 60 "$CLUSTER" exec 0 "$LOOM" launch "$@" > "$WORK/err.txt" 2>&1 || rc=$?
  ((rc != 0)) || fail "launch $*: exit 0"
  grep -qF -- "$want" "$WORK/err.txt" || fail "launch $*: no '$want' in: $(cat "$WORK/err.txt")"
  [[ ! -e $WORK/never ]] || fail "launch $*: it trained"
  echo "ok: bad input refused: $(grep -m1 -F -- "$want" "$WORK/err.txt")"
}
t=(-- train --config "$WORK/train.json" --out "$WORK/never")
expect_error "--hosts: host node7 cannot be reached: a one-rank job there exited" \
  --hosts node0:2,node7:2 --mpirun-args "$ARGS" "${t[@]}"
expect_error "--np 6 is more than the 4 slots of --hosts node0:2,node1:2" \
  --hosts node0:2,node1:2 --np 6 --mpirun-args "$ARGS" "${t[@]}"
expect_error "--min-hosts 3 is more than the 2 hosts of --hosts node0:2,node1:2" \
  --hosts node0:2,node1:2 --min-hosts 3 --mpirun-args "$ARGS" "${t[@]}"
expect_error "--hosts node0:2,node0:1: host node0 is listed twice" \
  --hosts node0:2,node0:1 --mpirun-args "$ARGS" "${t[@]}"
expect_error "the train command needs --out DIR" --hosts node0:2 --max-restarts 1 \
  --mpirun-args "$ARGS" -- train --config "$WORK/train.json"
expect_error "comm.ranks_per_node = 4 contradicts the hosts of this job" \
  --hosts node0:2,node1:2 --mpirun-args "$ARGS" "${t[@]}" --set comm.ranks_per_node=4

# The reference, with world rank 3 (on node1) 60 ms slower every step.
LOOM_TEST_SLOW=3:60 launch --hosts node0:2,node1:2 --mpirun-args "$ARGS" -- train \
  --config "$WORK/train.json" --out "$WORK/ref" > "$WORK/ref.txt" 2>&1 ||
  fail "reference run: $(cat "$WORK/ref.txt")"
grep -q "loom: warning: step [0-9]*: straggler: rank 3 on node1 computes for" "$WORK/ref.txt" ||
  fail "no straggler warning for rank 3 on node1: $(grep -a 'straggler\|warning' "$WORK/ref.txt")"
python3 - "$WORK/ref/metrics.jsonl" <<'PY' || fail "straggler scores"
import json, sys
last = [json.loads(l) for l in open(sys.argv[1])][-1]["ranks"]
# Rank 0's own writing moves its score by up to a quarter on a loaded
# machine (measured 0.79 once). Rank 3's score does not fall with the delay
# as 1/t: the others' measured compute grows with it (60 and 120 ms both
# gave 0.38-0.39; 30 ms gave 0.53 on a loaded machine).
assert last["score"][3] < 0.5 and min(last["score"][:3]) > 0.6, last
print("ok: straggler: rank 3 scores %.2f, the others %s" % (last["score"][3], last["score"][:3]))
PY
grep -a -m1 "straggler: rank 3" "$WORK/ref.txt"

# start NAME FAULT: a launch with up to 2 restarts; FAULT (cluster.sh kill 1 or
# cut 1) once step 15 is done. Sets T_FAULT.
start() {
  local name=$1
  shift
  timeout -k 5 200 "$CLUSTER" exec 0 "$LOOM" launch --hosts node0:2,node1:2 --max-restarts 2 \
    --mpirun-args "$ARGS" -- train --config "$WORK/train.json" --out "$WORK/$name" \
    > "$WORK/$name.txt" 2>&1 &
  job=$!
  JOBS+=("$job")
  until_within 60 grep -aq "step 15/" "$WORK/$name.txt" || fail "$name: no step 15: $(cat "$WORK/$name.txt")"
  T_FAULT=$SECONDS
  "$CLUSTER" "$@"
}
# finish NAME: waits for the restart and the end; prints the time from the
# fault to the resumed run's first step and what the checkpoint folder holds.
finish() {
  local name=$1 rc=0
  until_within 120 grep -aq "loom: resumed from latest" "$WORK/$name.txt" ||
    fail "$name: no resumed run: $(cat "$WORK/$name.txt")"
  local resumed=$((SECONDS - T_FAULT))
  wait "$job" || rc=$?
  ((rc == 0)) || fail "$name: launch exited $rc: $(cat "$WORK/$name.txt")"
  echo "$name: fault to resumed: ${resumed} s; checkpoints: $(ls "$WORK/$name/checkpoints" | tr '\n' ' ')"
}
restart_mark() {
  python3 -c 'import json,sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    if "restart" in j: print(j["step"], j["restart"]["count"], j["restart"]["world"], j["restart"]["cause"])' \
    "$WORK/$1/metrics.jsonl"
}

# A killed host: restart on both hosts, bit for bit.
start kill kill 1
finish kill
grep -a "loom launch:" "$WORK/kill.txt"
grep -aq "loom launch: the job failed: .*(host node1)" "$WORK/kill.txt" ||
  fail "kill: the failed host is not named: $(cat "$WORK/kill.txt")"
mark=$(restart_mark kill)
[[ $mark =~ ^[0-9]+\ 1\ 4\ .*node1 ]] || fail "kill: restart mark '$mark'"
diff <(losses "$WORK/ref") <(losses "$WORK/kill") > /dev/null ||
  fail "kill: losses differ from the uninterrupted run: $(diff <(losses "$WORK/ref") <(losses "$WORK/kill") | head)"
echo "ok: host killed: restarted at step ${mark%% *} on 4 ranks, all 50 losses bitwise as uninterrupted"

# A cut link: restart on node0 alone at dp 2.
start cut cut 1
finish cut
"$CLUSTER" heal 1
grep -a "loom launch:" "$WORK/cut.txt"
grep -aq "loom launch: host node1 is unreachable" "$WORK/cut.txt" || fail "cut: node1 not found unreachable"
grep -aq "loom launch: restarted: 2 ranks on node0:2" "$WORK/cut.txt" || fail "cut: no restart on node0"
mark=$(restart_mark cut)
[[ $mark =~ ^[0-9]+\ 1\ 2\ .*unreachable:\ node1 ]] || fail "cut: restart mark '$mark'"
from=$((${mark%% *} - 1))
grep -aq "batch 16 = micro-batch 2 x accumulation 4 x data-parallel 2" "$WORK/cut.txt" ||
  fail "cut: the restart did not keep the global batch"
# The same checkpoint resumed by hand at dp 2, on one host.
ckpt=$(printf '%s/cut/checkpoints/step-%08d' "$WORK" "$from")
cp -r "$ckpt" "$WORK/manual-ckpt"
"$CLUSTER" exec 0 mpirun --allow-run-as-root -np 2 -x OMP_NUM_THREADS "$LOOM" train \
  --config "$WORK/train.json" --out "$WORK/manual" --resume "$WORK/manual-ckpt" \
  > "$WORK/manual.txt" 2>&1 || fail "manual resume: $(cat "$WORK/manual.txt")"
diff <(losses "$WORK/cut" | awk -v f="$from" '$1 > f') <(losses "$WORK/manual" | awk -v f="$from" '$1 > f') \
  > /dev/null || fail "cut: losses after the restart differ from a resume at dp 2"
diff <(losses "$WORK/ref" | awk -v f="$from" '$1 <= f') <(losses "$WORK/cut" | awk -v f="$from" '$1 <= f') \
  > /dev/null || fail "cut: losses before the failure differ from the reference"
echo "ok: link cut: restarted at step $((from + 1)) on node0 at dp 2, losses bitwise like a resume at dp 2"
until_within 60 test "$(in_hosts)" -eq 0 || fail "processes left in the hosts"

# SIGTERM to the launcher stops the job; it is no failure to restart from.
"$CLUSTER" exec 0 "$LOOM" launch --hosts node0:2,node1:2 --max-restarts 3 --mpirun-args "$ARGS" \
  -- train --config "$WORK/train.json" --out "$WORK/stop" --set train.steps=5000 > "$WORK/stop.txt" 2>&1 &
job=$!
JOBS+=("$job")
until_within 60 grep -aq "step 3/" "$WORK/stop.txt" || fail "stop: no step 3: $(cat "$WORK/stop.txt")"
launcher=$(pgrep -f -- "launch --hosts node0:2,node1:2 --max-restarts 3" | head -1)
kill -TERM "$launcher"
rc=0
wait "$job" || rc=$?
((rc == 143)) || fail "stop: exit $rc, not 143: $(tail -5 "$WORK/stop.txt")"
grep -aq "loom launch: stopped by signal 15; no restart" "$WORK/stop.txt" || fail "stop: no final word"
! grep -aq "loom launch: restarted" "$WORK/stop.txt" || fail "stop: it restarted"
until_within 30 test "$(in_hosts)" -eq 0 || fail "stop: processes left in the hosts"
echo "ok: SIGTERM to loom launch: the job stopped (exit 143), no restart, nothing left"
echo PASS
