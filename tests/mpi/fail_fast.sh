#!/usr/bin/env bash
# A rank that throws ends the whole job at once with its own message, from
# any point of a step (LOOM_TEST_THROW, core/fault.h): mid-forward,
# mid-backward with gradient reductions in flight, with a pipeline receive
# posted ahead, with a ZeRO-3 gather or a ZeRO-2 reduce-scatter in flight,
# while a checkpoint is half written, during evaluation. Each job must exit
# non-zero within 10 s (comm.timeout_s is 60: a job that only ends by a
# timeout fails), print the failing rank's message before any other rank's
# report, leave no rank running, and leave the checkpoint folder with
# complete checkpoints only. Then the start-of-job checks: ranks with
# different configs or different loom builds are refused, naming the ranks.
set -euo pipefail
LOOM=${LOOM:?}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d)
export XDG_CACHE_HOME="$WORK/cache"
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

cat > "$WORK/train.json" <<JSON
{"train_batch_size": 8, "model": {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32},
 "data": {"synthetic": true}, "train": {"steps": 6, "eval_every": 2, "eval_steps": 1},
 "comm": {"timeout_s": 60}, "checkpoint": {"every": 1, "keep_last": 10}, "log": {"peak_gflops": 100}}
JSON

# fault PHASE RANK STEP [--set ...]: runs 4 ranks with the fault armed and
# checks the job's end.
fault() {
  local phase=$1 rank=$2 step=$3; shift 3
  local run="$WORK/run-$phase" t0 rc=0
  rm -rf "$run"
  t0=$(date +%s.%N)
  LOOM_TEST_THROW="$phase:$rank:$step" timeout 60 mpirun --oversubscribe -np 4 "$LOOM" train \
    --config "$WORK/train.json" --out "$run" "$@" > "$WORK/out.txt" 2>&1 || rc=$?
  local took
  took=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
  ((rc != 0 && rc != 124)) || fail "$phase: exit $rc: $(cat "$WORK/out.txt")"
  python3 -c "import sys; sys.exit(0 if $took < 10 else 1)" ||
    fail "$phase: the job took $took s to end: $(cat "$WORK/out.txt")"
  # The first rank report is the failing rank's own message.
  local first
  first=$(grep -o "loom: rank [0-9]*: .*" "$WORK/out.txt" | head -1)
  [[ $first == "loom: rank $rank: test fault: $phase at step $step (LOOM_TEST_THROW)" ]] ||
    fail "$phase: first report is '$first': $(cat "$WORK/out.txt")"
  ! grep -q "comm timeout" "$WORK/out.txt" || fail "$phase: a timeout was reported: $(cat "$WORK/out.txt")"
  sleep 0.5
  ! pgrep -f -- "--out $run" > /dev/null || fail "$phase: ranks left running: $(pgrep -af -- "--out $run")"
  # What the checkpoint folder holds: complete checkpoints only, `latest`
  # naming one of them.
  python3 - "$run" <<'PY' || fail "$phase: a damaged checkpoint folder"
import glob, hashlib, json, os, sys
run = sys.argv[1]
for d in glob.glob(run + "/checkpoints/step-*"):
    m = json.load(open(d + "/manifest.json"))
    for name, info in m["files"].items():
        data = open(os.path.join(d, name), "rb").read()
        assert len(data) == info["bytes"] and hashlib.sha256(data).hexdigest() == info["sha256"], name
latest = run + "/checkpoints/latest"
if os.path.exists(latest):
    assert os.path.isdir(run + "/checkpoints/" + open(latest).read().strip()), "latest dangles"
PY
  local kept
  kept=$(ls "$run/checkpoints" 2>/dev/null | grep -c '^step-' || true)
  echo "ok: $phase on rank $rank at step $step: ended in $took s (exit $rc), $kept complete checkpoint(s) kept"
}

pipe=(--set parallel.pipeline=2 --set gradient_accumulation_steps=2)
fault forward 1 3
fault backward 2 3
fault pipeline 3 3 "${pipe[@]}"
fault pipeline 0 2 "${pipe[@]}" --set parallel.schedule=1f1b
fault zero_gather 1 2 --set zero_optimization.stage=3
fault zero_reduce 2 2 --set zero_optimization.stage=2
fault checkpoint 3 2
fault eval 0 2
fault backward 1 2 --set parallel.tensor=2

# Ranks with different configs (an MPMD launch with a different --set on
# one rank): refused at start, naming the ranks and the first differing key.
rc=0
timeout 60 mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/train.json" --out "$WORK/mpmd" \
  : -np 2 "$LOOM" train --config "$WORK/train.json" --out "$WORK/mpmd" --set train.seed=7 \
  > "$WORK/out.txt" 2>&1 || rc=$?
((rc != 0 && rc != 124)) || fail "mismatched configs: exit $rc"
grep -q "the ranks loaded different configs: rank(s) 2, 3 differ from rank 0; the first differing key is 'train.seed': 1234 on rank 0, 7 on rank 2" \
  "$WORK/out.txt" || fail "no report of the differing config: $(cat "$WORK/out.txt")"
[[ ! -e "$WORK/mpmd/metrics.jsonl" ]] || fail "mismatched configs trained"
echo "ok: a rank-dependent config is refused"

# Ranks running different loom builds (another binary on rank 1).
cp "$LOOM" "$WORK/loom-other"
printf 'x' >> "$WORK/loom-other"  # a different executable that still runs
rc=0
timeout 60 mpirun --oversubscribe -np 1 "$LOOM" train --config "$WORK/train.json" --out "$WORK/builds" \
  : -np 1 "$WORK/loom-other" train --config "$WORK/train.json" --out "$WORK/builds" \
  > "$WORK/out.txt" 2>&1 || rc=$?
((rc != 0 && rc != 124)) || fail "mismatched builds: exit $rc"
grep -q "the ranks run different loom builds: rank(s) 1 run an executable other than rank 0's" \
  "$WORK/out.txt" || fail "no report of the differing build: $(cat "$WORK/out.txt")"
echo "ok: ranks of different builds are refused"
echo PASS
