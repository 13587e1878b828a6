#!/usr/bin/env bash
# A failing rank ends the whole job, never a hang: killed (kill -9), frozen
# (SIGSTOP: its peers time out and report it as not answering), or alive but
# late (its peers report it as not arrived). Each job must exit non-zero
# within its bound, with the message.
set -euo pipefail
LOOM=${LOOM:?} PROBE=${PROBE:?}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# Starts an mpirun job in the background; sets $job.
start() { mpirun --oversubscribe -np 4 "$@" > "$WORK/out.txt" 2>&1 & job=$!; }
# Waits for the job to end within $1 seconds; fails on a hang or a zero exit.
finish_within() {
  local limit=$1 t0=$SECONDS rc=0
  while kill -0 "$job" 2>/dev/null; do
    ((SECONDS - t0 <= limit)) || { kill -9 "$job"; fail "job still running after ${limit}s"; }
    sleep 0.2
  done
  wait "$job" || rc=$?
  ((rc != 0)) || fail "job exited 0"
  echo "ended in $((SECONDS - t0)) s with exit $rc"
}
rank_pid() { pgrep -P "$job" | sort -n | sed -n "$(($1 + 1))p"; }

long=(bench comm --op allreduce --algo ring --min 1M --max 1M --iters 1000000 --warmup 0)

# 1. kill -9 of rank 2 in the middle of a long loop of all-reduces: the
# launcher ends the job, and no rank of it is left running.
start "$LOOM" "${long[@]}" --set comm.timeout_s=10
sleep 3
kill -9 "$(rank_pid 2)"
finish_within 30
grep -q "exited on signal 9" "$WORK/out.txt" || fail "no report of the killed rank: $(cat "$WORK/out.txt")"
sleep 1
! pgrep -f -- "loom bench comm" > /dev/null || fail "ranks left running: $(pgrep -af -- "loom bench comm")"
echo "ok: kill -9"
# 1b. The same with the launcher told to keep a job whose rank died
# (--enable-recovery): loom's own watchdog ends it within the timeout,
# naming the operation and the dead rank.
mpirun --oversubscribe --enable-recovery -np 4 "$LOOM" "${long[@]}" --set comm.timeout_s=4 \
  > "$WORK/out.txt" 2>&1 & job=$!
sleep 3
kill -9 "$(rank_pid 2)"
t0=$SECONDS
while kill -0 "$job" 2>/dev/null; do
  ((SECONDS - t0 <= 30)) || { kill -9 "$job"; fail "job still running 30 s after a rank died"; }
  sleep 0.2
done
wait "$job" || true
grep -Eq "loom: rank [013]: comm timeout: allreduce #[0-9]+ \(262144 x f32, sum\) in group 'world' \(size 4\) did not complete within comm.timeout_s = 4 s; .*ranks that did not answer: 2 \(world 2 on [^)]*\)" \
  "$WORK/out.txt" || fail "no loom report naming the dead rank: $(cat "$WORK/out.txt")"
! pgrep -f -- "loom bench comm" > /dev/null || fail "ranks left running: $(pgrep -af -- "loom bench comm")"
echo "ok: kill -9, loom's own report"

# 2. SIGSTOP of rank 1: the others time out and name it.
start "$LOOM" "${long[@]}" --set comm.timeout_s=3
sleep 3
frozen=$(rank_pid 1)
kill -STOP "$frozen"
finish_within 40
kill -9 "$frozen" 2>/dev/null || true
grep -q "comm timeout: allreduce #[0-9]* (262144 x f32, sum) in group 'world' (size 4) did not complete within comm.timeout_s = 3 s" "$WORK/out.txt" ||
  fail "no timeout report: $(cat "$WORK/out.txt")"
grep -Eq "ranks that did not answer: 1 \(world 1 on [^)]*\)" "$WORK/out.txt" || fail "frozen rank not named: $(cat "$WORK/out.txt")"
echo "ok: SIGSTOP"

# 3. Rank 1 alive but late: reported as not arrived, with its position.
start "$PROBE"
finish_within 30
grep -q "comm timeout: allreduce #2 (1000 x f32, sum) in group 'world'" "$WORK/out.txt" ||
  fail "no timeout report: $(cat "$WORK/out.txt")"
grep -Eq "ranks that had not arrived: 1 \(world 1 on [^,]*, at #1\)" "$WORK/out.txt" ||
  fail "late rank not named: $(cat "$WORK/out.txt")"
echo "ok: late rank"
# 3b. A point-to-point message that never comes: the report names it and
# the peer (not the collective counters, which it does not move).
start "$PROBE" p2p
finish_within 30
grep -q "comm timeout: pipeline receive of the activation of micro-batch 3 (chunk 0) from stage 0: recv #1 (1000 x f32, peer 0) in group 'world' did not complete within comm.timeout_s = 2 s: its peer, rank 0 of the group (world rank 0), never posted the matching send" "$WORK/out.txt" ||
  fail "no point-to-point timeout report: $(cat "$WORK/out.txt")"
echo "ok: point-to-point timeout"
# 4. kill -9 of a rank during a data-parallel training run that saves every
# step. Beyond the launcher's report, loom's own exit path: no rank of the
# job is left running, every checkpoint in the run folder is complete and
# verifies, `latest` names one of them, and metrics.jsonl has no torn line.
cat > "$WORK/train.json" <<JSON
{"train_batch_size": 8, "model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32},
 "data": {"synthetic": true}, "train": {"steps": 1000000}, "comm": {"timeout_s": 10},
 "checkpoint": {"every": 1, "keep_last": 3}, "log": {"peak_gflops": 100}}
JSON
start "$LOOM" train --config "$WORK/train.json" --out "$WORK/run"
sleep 4
kill -9 "$(rank_pid 3)"
finish_within 30
grep -q "exited on signal 9" "$WORK/out.txt" || fail "no report of the killed rank: $(cat "$WORK/out.txt")"
sleep 1
! pgrep -f -- "--out $WORK/run" > /dev/null || fail "ranks left running: $(pgrep -af -- "--out $WORK/run")"
[[ -f "$WORK/run/checkpoints/latest" ]] || fail "no checkpoint before the kill"
[[ -d "$WORK/run/checkpoints/$(cat "$WORK/run/checkpoints/latest")" ]] || fail "latest dangles"
python3 - "$WORK/run" <<'PY' || fail "a checkpoint or metrics.jsonl damaged by the kill"
import glob, hashlib, json, os, sys
run = sys.argv[1]
for d in glob.glob(run + "/checkpoints/step-*"):
    m = json.load(open(d + "/manifest.json"))
    files = m["files"]
    # Sharded: each of the 4 ranks' files, and the run's state.
    ranks = {"rank-%05d.safetensors" % r for r in range(4)}
    assert m["format"] == "loom checkpoint v2" and ranks | {"trainer_state.json"} <= set(files), d
    for name, info in files.items():
        data = open(os.path.join(d, name), "rb").read()
        assert len(data) == info["bytes"] and hashlib.sha256(data).hexdigest() == info["sha256"], name
[json.loads(l) for l in open(run + "/metrics.jsonl")]
PY
echo "ok: kill -9 during training (no rank left, checkpoints complete, metrics whole)"
# 5. A frozen stage in a 4-stage pipeline: the job ends with a timeout that
# names it (its neighbours' messages, or a collective it never joined).
start "$LOOM" train --config "$WORK/train.json" --out "$WORK/pp" --set parallel.pipeline=4 \
  --set gradient_accumulation_steps=4 --set model.n_layer=4 --set comm.timeout_s=3
sleep 4
frozen=$(rank_pid 2)
kill -STOP "$frozen"
finish_within 40
kill -9 "$frozen" 2>/dev/null || true
grep -Eq "comm timeout: .*(from stage 2|to stage 2|rank 2 of the group|2 \(world 2)" "$WORK/out.txt" ||
  fail "no timeout naming the frozen stage: $(cat "$WORK/out.txt")"
echo "ok: frozen pipeline stage"
echo PASS
