#!/usr/bin/env bash
# loom report: a 2-stage pipeline run with evaluation, fp16 with forced
# skips (a loss scale of 2^20 overflows the first steps) and a MoE layer,
# its page opened in headless Chromium and checked from the page itself
# (report_check.mjs: panels, series and points against metrics.jsonl, no
# request, no error); a truncated metrics.jsonl still gives a page that
# notes the damage; bad input gets one clear line; log.report_every writes
# the page during the run, and a page opened mid-run reloads itself until
# the run's final page (report_live.mjs).
source "$(dirname "$0")/lib.sh"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
here=$(cd "$(dirname "$0")" && pwd)
export LOOM_NPM_DIR=${LOOM_NPM_DIR:-$here/../../.cache/npm}
artifacts=${LOOM_TEST_ARTIFACTS:-$here/../../build/test-artifacts}
mkdir -p "$artifacts"

mkdir -p "$WORK/text"
for i in $(seq 1 200); do echo "line $i: the quick brown fox jumps over the lazy dog."; done > "$WORK/text/a.txt"
"$LOOM" prepare-data --input "$WORK/text" --tokenizer byte --val-fraction 0.2 --out "$WORK/data" >/dev/null
cat > "$WORK/cfg.json" <<JSON
{"train_batch_size": 8, "gradient_accumulation_steps": 4,
 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
 "fp16": {"enabled": true, "initial_scale_power": 20},
 "model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "seq_len": 32,
           "moe": {"num_experts": 4, "top_k": 2, "every_n_layers": 2}},
 "parallel": {"pipeline": 2},
 "data": {"train": "$WORK/data/train.bin", "val": "$WORK/data/val.bin"},
 "train": {"steps": 16, "eval_every": 4, "eval_steps": 2},
 "log": {"every": 4, "trace": true, "report_every": 5, "profile": true}}
JSON
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --out "$WORK/run" > "$WORK/train.txt" 2>&1 ||
  fail "training: $(tail -20 "$WORK/train.txt")"
json_check "$WORK/run/metrics.jsonl" 'len(lines) == 16 and lines[-1]["skipped_steps"] > 0 and all(abs(sum(m["load"]) - 1) < 1e-9 for l in lines for m in l["moe"])'

json_check "$WORK/run/run.json" 'd["world"] == 2 and d["partition"] == [1, 1] and d["cpu"] and d["loom_version"]'
# log.report_every: the run's own page, final (not live) after the last step.
[[ -s $WORK/run/report.html ]] || fail "log.report_every wrote no report.html"
grep -q '"live":false' "$WORK/run/report.html" || fail "the last report.html is still live"
node "$here/report_check.mjs" "$WORK/run/report.html" "$WORK/run" "$artifacts/report-live.png"

"$LOOM" report "$WORK/run" --out "$WORK/report.html" > "$WORK/report.txt"
grep -q "loom: report $WORK/report.html: 1 run, 16 steps" "$WORK/report.txt" || fail "summary: $(cat "$WORK/report.txt")"
node "$here/report_check.mjs" "$WORK/report.html" "$WORK/run" "$artifacts/report.png"
echo "screenshot: $artifacts/report.png"

# A killed run's last line is cut short: the page is made, the damage noted.
cp -rp "$WORK/run" "$WORK/cut"
rm -f "$WORK/cut/trace.json"
python3 - "$WORK/cut/metrics.jsonl" <<'PY'
import sys
p = sys.argv[1]
text = open(p).read()
open(p, "w").write(text[: len(text) - 40])
PY
"$LOOM" report "$WORK/cut" --out "$WORK/cut.html" > "$WORK/cut.txt"
grep -q "loom: report: cut: metrics.jsonl line 16 is incomplete (being written, or the run stopped while writing it): skipped" "$WORK/cut.txt" ||
  fail "truncation not noted: $(cat "$WORK/cut.txt")"
grep -q "15 steps" "$WORK/cut.txt" || fail "the truncated run's 15 whole steps: $(cat "$WORK/cut.txt")"
node "$here/report_check.mjs" "$WORK/cut.html" "$WORK/cut" "$WORK/cut.png" "metrics.jsonl line 16 is incomplete"

# Two runs of different models overlaid: allowed, labelled.
mkdir -p "$WORK/small"
cp "$WORK/run/metrics.jsonl" "$WORK/small/"
python3 - "$WORK/run/config.resolved.json" "$WORK/small/config.resolved.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["model"]["n_embd"] = 16
json.dump(c, open(sys.argv[2], "w"))
PY
"$LOOM" report "$WORK/run" "$WORK/small" --out "$WORK/two.html" > "$WORK/two.txt"
grep -q "loom: report: the runs train different models: run: .*n_embd 32.*; small: .*n_embd 16" "$WORK/two.txt" ||
  fail "different models not labelled: $(cat "$WORK/two.txt")"
grep -q '"name":"small"' "$WORK/two.html" || fail "second run missing"
node "$here/report_two.mjs" "$WORK/two.html" || fail "two runs overlaid"

# Bad input: one line naming the folder and the reason.
expect_error "$WORK/nothing does not exist" "$LOOM" report "$WORK/nothing" --out "$WORK/x.html"
expect_error "$WORK/data is not a run folder: it has no metrics.jsonl" "$LOOM" report "$WORK/data" --out "$WORK/x.html"
mkdir -p "$WORK/empty"
cp "$WORK/run/config.resolved.json" "$WORK/empty/"
: > "$WORK/empty/metrics.jsonl"
expect_error "$WORK/empty has no steps yet: metrics.jsonl is empty" "$LOOM" report "$WORK/empty" --out "$WORK/x.html"
[[ ! -e $WORK/x.html ]] || fail "a failed report wrote a page"

# Live: the page opened while a run goes (every step slowed to 400 ms)
# reloads itself, each time at a later step, until the final page.
python3 - "$WORK/cfg.json" "$WORK/live.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
del c["parallel"], c["fp16"], c["model"]["moe"]
c["train"] = {"steps": 24}
c["log"] = {"every": 1, "report_every": 3}
json.dump(c, open(sys.argv[2], "w"))
PY
LOOM_TEST_SLOW=0:400 "$LOOM" train --config "$WORK/live.json" --out "$WORK/live" > "$WORK/live.txt" 2>&1 &
train_pid=$!
for _ in $(seq 1 300); do [[ -s $WORK/live/report.html ]] && break; sleep 0.1; done
[[ -s $WORK/live/report.html ]] || fail "no live report.html within 30 s: $(tail -5 "$WORK/live.txt")"
node "$here/report_live.mjs" "$WORK/live/report.html" 24 || { kill $train_pid 2>/dev/null; fail "live page"; }
wait $train_pid || fail "live training: $(tail -20 "$WORK/live.txt")"

# A live page its run stopped rewriting (killed with no last page) says it
# is stale and stops reloading.
sed 's/"generated_epoch":[0-9]*/"generated_epoch":1000/; s/"live":false/"live":true/' \
  "$WORK/live/report.html" > "$WORK/stale.html"
node "$here/report_live.mjs" "$WORK/stale.html" stale || fail "stale page"

# A run that fails: its last page says how it ended and is not live.
LOOM_TEST_THROW=forward:0:7 "$LOOM" train --config "$WORK/live.json" --out "$WORK/failed" \
  > "$WORK/failed.txt" 2>&1 && fail "the failing run succeeded"
grep -q '"live":false' "$WORK/failed/report.html" || fail "the failed run's page is still live"
grep -q '"stopped":"the run stopped at step 7 of 24: test fault: forward at step 7' "$WORK/failed/report.html" ||
  fail "the failed run's page does not say why: $(grep -o '"stopped":"[^"]*"' "$WORK/failed/report.html")"
echo "report: ok"
