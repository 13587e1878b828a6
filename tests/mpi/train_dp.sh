#!/usr/bin/env bash
# `mpirun -np 2 loom train` as a user runs it: rank 0 alone writes the run
# folder; metrics carry the communication figures; checkpoints resume exactly
# under mpirun too; config errors end the job with their message.
set -euo pipefail
LOOM=${LOOM:?}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

cat > "$WORK/cfg.json" <<JSON
{"train_batch_size": 8, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
 "model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32, "dropout": 0.1},
 "data": {"synthetic": true}, "train": {"steps": 6, "seed": 9},
 "zero_optimization": {"reduce_bucket_size": 30000},
 "checkpoint": {"every": 3}, "log": {"peak_gflops": 100}}
JSON
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --out "$WORK/a" > "$WORK/out.txt" 2>&1 ||
  fail "training failed: $(cat "$WORK/out.txt")"
grep -q "data parallel over 2 ranks" "$WORK/out.txt" || fail "no data-parallel line"
[[ $(grep -c "loom: done in" "$WORK/out.txt") == 1 ]] || fail "only rank 0 should print the summary"
python3 - "$WORK/a" <<'PY' || fail "metrics"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
assert [l["step"] for l in lines] == list(range(1, 7)), lines
for l in lines:
    assert l["time"]["comm"] > 0 and l["time"]["comm_exposed"] >= 0 and l["comm_bytes"] > 0, l
    assert 0 < l["mfu"] <= 1, l  # the job's FLOP/s against every rank's peak
cfg = json.load(open(sys.argv[1] + "/config.resolved.json"))
assert cfg["parallel"]["data"] == 2 and cfg["train_micro_batch_size_per_gpu"] == 4, cfg
print("ok: metrics with comm", lines[-1]["time"]["comm"], lines[-1]["comm_bytes"])
PY
# Tensor parallelism from the CLI: tp 2, its communication in the metrics,
# then resumed in one process from its checkpoint (resharded on load).
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set parallel.tensor=2 \
  --out "$WORK/tp" > "$WORK/out-tp.txt" 2>&1 || fail "tp training failed: $(cat "$WORK/out-tp.txt")"
grep -q "loom: tensor parallel over 2 ranks: each holds 2 of 4 heads, 128 of 256 MLP features and 128 of 256 vocabulary rows" \
  "$WORK/out-tp.txt" || fail "no tensor-parallel line: $(cat "$WORK/out-tp.txt")"
"$LOOM" train --config "$WORK/cfg.json" --out "$WORK/tp1" \
  --resume "$WORK/tp/checkpoints/step-00000003" > "$WORK/out-tp1.txt" 2>&1 ||
  fail "one-process resume of a tp checkpoint: $(cat "$WORK/out-tp1.txt")"
python3 - "$WORK/a/metrics.jsonl" "$WORK/tp/metrics.jsonl" "$WORK/tp1/metrics.jsonl" <<'PY' || fail "tp run"
import json, sys
dp, tp, one = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert all(l["time"]["comm"] > 0 and l["comm_bytes"] > 0 for l in tp), tp
for a, b in zip(dp, tp):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])
assert [l["step"] for l in one] == [4, 5, 6], one
for a, b in zip(tp[3:], one):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])
print("ok: tp 2 trains like dp 2 and resumes in one process:", [round(l["loss"], 5) for l in one])
PY
# Expert parallelism from the CLI: a MoE model at ep 2 (each rank holds 2 of
# the 4 experts), its all-to-alls in the metrics, trains like ep 1; its
# checkpoint resumes in one process.
moe=(--set 'model.moe={"num_experts": 4, "top_k": 2, "every_n_layers": 2}')
for ep in 1 2; do
  mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" "${moe[@]}" \
    --set parallel.expert=$ep --out "$WORK/ep$ep" > "$WORK/out-ep$ep.txt" 2>&1 ||
    fail "ep $ep training failed: $(cat "$WORK/out-ep$ep.txt")"
done
grep -q "experts split over 2 expert-parallel ranks, 2 each" "$WORK/out-ep2.txt" ||
  fail "no expert-parallel line: $(cat "$WORK/out-ep2.txt")"
"$LOOM" train --config "$WORK/cfg.json" "${moe[@]}" --out "$WORK/ep-one" \
  --resume "$WORK/ep2/checkpoints/step-00000003" > "$WORK/out-ep-one.txt" 2>&1 ||
  fail "one-process resume of an ep checkpoint: $(cat "$WORK/out-ep-one.txt")"
python3 - "$WORK/ep1/metrics.jsonl" "$WORK/ep2/metrics.jsonl" "$WORK/ep-one/metrics.jsonl" <<'PY' || fail "ep run"
import json, sys
ep1, ep2, one = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert all(l["time"]["all_to_all"] > 0 for l in ep2) and all(l["time"]["all_to_all"] == 0 for l in ep1)
for a, b in zip(ep1, ep2):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])
assert [l["step"] for l in one] == [4, 5, 6], one
for a, b in zip(ep2[3:], one):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])
print("ok: ep 2 trains like ep 1 and resumes in one process:", [round(l["loss"], 5) for l in one])
PY
expect_fail() {
  local want=$1
  shift
  if "$@" > "$WORK/err.txt" 2>&1; then fail "expected an error: $want"; fi
  grep -q "$want" "$WORK/err.txt" || fail "expected '$want', got: $(cat "$WORK/err.txt")"
}
expect_fail "model.moe.num_experts 3 is not divisible by parallel.expert 2" \
  mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set parallel.expert=2 \
  --set 'model.moe={"num_experts": 3, "top_k": 1}' --out "$WORK/ep-bad"
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --out "$WORK/b" \
  --resume "$WORK/a/checkpoints/step-00000003" > "$WORK/out2.txt" 2>&1 || fail "resume: $(cat "$WORK/out2.txt")"
python3 - "$WORK/a/metrics.jsonl" "$WORK/b/metrics.jsonl" <<'PY' || fail "resume under mpirun is not exact"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert [l["loss"] for l in a[3:]] == [l["loss"] for l in b], (a[3:], b)
print("ok: exact resume under mpirun")
PY
# ZeRO stage 1: optimizer state sharded; a stage-1 run resumes exactly from a
# stage-0 checkpoint (resharded on load).
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set zero_optimization.stage=1 \
  --out "$WORK/z" > "$WORK/outz.txt" 2>&1 || fail "zero-1 training: $(cat "$WORK/outz.txt")"
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set zero_optimization.stage=1 \
  --out "$WORK/z2" --resume "$WORK/a/checkpoints/step-00000003" > "$WORK/outz2.txt" 2>&1 ||
  fail "zero-1 resume: $(cat "$WORK/outz2.txt")"
python3 - "$WORK/a/metrics.jsonl" "$WORK/z/metrics.jsonl" "$WORK/z2/metrics.jsonl" <<'PY' || fail "zero-1 differs"
import json, sys
a, z, z2 = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
for x, y in zip(a, z):
    assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], (x["loss"], y["loss"])
for x, y in zip(a[3:], z2):
    assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], (x["loss"], y["loss"])
print("ok: zero-1 matches stage 0, and resumes from a stage-0 checkpoint")
PY
# ZeRO stage 3 (parameters sharded): same losses; each rank saves its own
# shard, and one process without ZeRO resumes from them exactly.
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set zero_optimization.stage=3 \
  --out "$WORK/z3" > "$WORK/outz3.txt" 2>&1 || fail "zero-3 training: $(cat "$WORK/outz3.txt")"
grep -q "ZeRO stage 3" "$WORK/outz3.txt" || fail "no ZeRO stage line: $(cat "$WORK/outz3.txt")"
"$LOOM" train --config "$WORK/cfg.json" --out "$WORK/z3r" \
  --resume "$WORK/z3/checkpoints/step-00000003" > "$WORK/outz3r.txt" 2>&1 ||
  fail "resume of a zero-3 checkpoint in one process: $(cat "$WORK/outz3r.txt")"
# Stage 2 with the optimizer state in files under nvme_path.
mkdir -p "$WORK/nvme"
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set zero_optimization.stage=2 \
  --set zero_optimization.offload_optimizer.device=nvme \
  --set zero_optimization.offload_optimizer.nvme_path="$WORK/nvme" \
  --out "$WORK/z2n" > "$WORK/outz2n.txt" 2>&1 || fail "zero-2 nvme training: $(cat "$WORK/outz2n.txt")"
grep -q "memory-mapped file under $WORK/nvme" "$WORK/outz2n.txt" || fail "no nvme line"
[[ -z $(ls -A "$WORK/nvme") ]] || fail "optimizer files left behind: $(ls -A "$WORK/nvme")"
python3 - "$WORK/a/metrics.jsonl" "$WORK/z3/metrics.jsonl" "$WORK/z3r/metrics.jsonl" \
  "$WORK/z2n/metrics.jsonl" <<'PY' || fail "zero-2/3 differ"
import json, sys
a, z3, z3r, z2n = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
for run in (z3, z2n):
    assert len(run) == len(a)
    for x, y in zip(a, run):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], (x["loss"], y["loss"])
for x, y in zip(a[3:], z3r):
    assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], (x["loss"], y["loss"])
# Stage 3 holds half the parameters of stage 0 on each of the 2 ranks.
assert z3[-1]["mem"]["params"] * 2 <= a[-1]["mem"]["params"] + 64 * 4, (z3[-1]["mem"], a[-1]["mem"])
print("ok: zero-2 (nvme) and zero-3 match stage 0; a zero-3 checkpoint resumes in one process")
PY
# Pipeline parallelism from the CLI: pp 2 with 1F1B over 4 micro-batches,
# the bubble in the metrics, the timeline in trace.json, and its checkpoint
# resumed in one process.
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set parallel.pipeline=2 \
  --set gradient_accumulation_steps=4 --set log.trace=true --out "$WORK/pp" > "$WORK/out-pp.txt" 2>&1 ||
  fail "pp training failed: $(cat "$WORK/out-pp.txt")"
grep -q "loom: pipeline 1f1b over 2 stages, 4 micro-batches per step; blocks per part \[0, 1) \[1, 2) (partition uniform); bubble in theory 20.0%" \
  "$WORK/out-pp.txt" || fail "no pipeline line: $(cat "$WORK/out-pp.txt")"
"$LOOM" train --config "$WORK/cfg.json" --set gradient_accumulation_steps=4 --out "$WORK/pp1" \
  > "$WORK/out-pp1.txt" 2>&1 || fail "one-process reference: $(cat "$WORK/out-pp1.txt")"
"$LOOM" train --config "$WORK/cfg.json" --set gradient_accumulation_steps=4 --out "$WORK/ppr" \
  --resume "$WORK/pp/checkpoints/step-00000003" > "$WORK/out-ppr.txt" 2>&1 ||
  fail "one-process resume of a pp checkpoint: $(cat "$WORK/out-ppr.txt")"
python3 - "$WORK/pp" "$WORK/pp1/metrics.jsonl" "$WORK/ppr/metrics.jsonl" <<'PY' || fail "pp run"
import json, sys
pp = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
one, resumed = ([json.loads(l) for l in open(p)] for p in sys.argv[2:])
for a, b in zip(one, pp):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])
for l in pp:
    assert l["time"]["bubble"] > 0 and 0 < l["bubble_fraction"] < 1, l
    assert 0 < l["mfu"] <= 1, l
assert [l["step"] for l in resumed] == [4, 5, 6], resumed
for a, b in zip(pp[3:], resumed):
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a["loss"], b["loss"])
events = json.load(open(sys.argv[1] + "/trace.json"))["traceEvents"]
slices = [e for e in events if e["ph"] == "X"]
names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
assert names == {0: "rank 0: stage 0 (tp 0, dp 0, ep 0)", 1: "rank 1: stage 1 (tp 0, dp 0, ep 0)"}, names
rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
for rank in (0, 1):
    mine = [e for e in slices if e["pid"] == rank]
    assert all(e["dur"] >= 0 for e in mine)
    schedule = [e for e in mine if rows[(rank, e["tid"])] == "pipeline schedule"]
    # Per step: 4 forwards, 4 backwards, the reduction and the optimizer step.
    assert len(schedule) == 6 * 10, len(schedule)
    assert sum(e["cat"] == "forward" for e in schedule) == 24, schedule[:3]
    # The stage's block, forward and backward, per micro-batch.
    compute = [e for e in mine if e["cat"] == "compute" and e["name"].endswith(" h." + str(rank))]
    assert sum(e["name"].startswith("forward") for e in compute) == 6 * 4, compute[:3]
    # The activations (stage 0) or their gradients (stage 1): 4 sends a step,
    # on the pipeline group's row (the world's, on 2 ranks).
    sends = [e for e in mine if e["cat"] == "comm" and e["name"] == "send"]
    assert len(sends) == 6 * 4 and all(e["args"]["bytes_sent"] > 0 for e in sends), len(sends)
    assert all(rows[(rank, e["tid"])].startswith("comm: ") for e in sends)
for l in pp:
    assert sum(g["bytes"] for g in l["comm_groups"].values()) == l["comm_bytes"] > 0, l
print("ok: pp 2 trains like one process, bubble", round(pp[-1]["bubble_fraction"], 3),
      "trace", len(slices), "slices; resumes in one process")
PY
# A rank killed in the middle of a distributed save (LOOM_TEST_FAULT=
# PHASE@STEP:RANK), at each phase: the job ends, the previous checkpoint is
# intact and `latest` names it, and the job resumed from latest trains
# bitwise like one never interrupted. ZeRO-3, so each rank's file is its own
# shard; with async saves too.
for async in false true; do
  zcfg=(--set zero_optimization.stage=3 --set checkpoint.every=1 --set checkpoint.async=$async)
  mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" "${zcfg[@]}" \
    --out "$WORK/k-ref" --overwrite > "$WORK/out-kref.txt" 2>&1 || fail "reference: $(cat "$WORK/out-kref.txt")"
  for fault in partial@3:1 partial@3:0 rename@3 pointer@3; do
    rm -rf "$WORK/k"
    rc=0
    LOOM_TEST_FAULT=$fault mpirun --oversubscribe -np 2 -x LOOM_TEST_FAULT "$LOOM" train \
      --config "$WORK/cfg.json" "${zcfg[@]}" --out "$WORK/k" > "$WORK/out-k.txt" 2>&1 || rc=$?
    ((rc != 0)) || fail "$fault (async $async): the injected crash did not end the job"
    latest=$(cat "$WORK/k/checkpoints/latest")
    [[ $latest == step-00000002 ]] || fail "$fault (async $async): latest is $latest"
    "$LOOM" checkpoint verify "$WORK/k/checkpoints" > /dev/null || fail "$fault: step 2 damaged"
    mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" "${zcfg[@]}" --out "$WORK/k" \
      --resume latest > "$WORK/out-kr.txt" 2>&1 || fail "$fault: resume: $(cat "$WORK/out-kr.txt")"
    python3 - "$WORK/k-ref/metrics.jsonl" "$WORK/k/metrics.jsonl" <<'PY' || fail "$fault (async $async): resume not exact"
import json, sys
ref, got = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert [l["step"] for l in got] == list(range(1, 7)), got
assert [l["loss"] for l in got] == [l["loss"] for l in ref], (got, ref)
PY
  done
done
echo "ok: a rank killed at each phase of a distributed save leaves latest complete; resume bitwise"
# A non-finite gradient in a parameter that only the second pipeline stage
# holds: every rank stops with the same message naming it.
rc=0
LOOM_TEST_NONFINITE=2:transformer.h.1.mlp.c_fc.weight mpirun --oversubscribe -np 2 \
  -x LOOM_TEST_NONFINITE "$LOOM" train --config "$WORK/cfg.json" --set parallel.pipeline=2 \
  --set gradient_accumulation_steps=4 --out "$WORK/nf" > "$WORK/out-nf.txt" 2>&1 || rc=$?
((rc != 0)) || fail "non-finite gradient under pp 2 did not stop"
grep -Eq "rank [01]: step 2: non-finite gradient \(norm -?nan\) first in 'transformer.h.1.mlp.c_fc.weight'" \
  "$WORK/out-nf.txt" || fail "no non-finite message under mpirun: $(cat "$WORK/out-nf.txt")"
echo "ok: non-finite gradient on stage 1 of pp 2 stops every rank, naming the parameter"
rc=0
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set parallel.pipeline=2 \
  --set model.n_layer=1 --out "$WORK/pp-bad" > "$WORK/out-ppbad.txt" 2>&1 || rc=$?
((rc != 0)) || fail "a 1-layer model over 2 stages accepted"
grep -q "model.n_layer 1 is fewer than the 2 pipeline parts" "$WORK/out-ppbad.txt" ||
  fail "no pipeline message: $(cat "$WORK/out-ppbad.txt")"
echo "ok: pipeline config error under mpirun"
rc=0
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" \
  --set zero_optimization.stage=1 --set zero_optimization.offload_optimizer.device=nvme \
  --set zero_optimization.offload_optimizer.nvme_path=/proc/loom-nvme \
  --out "$WORK/d" > "$WORK/out4.txt" 2>&1 || rc=$?
((rc != 0)) || fail "unwritable nvme_path accepted"
grep -q "zero_optimization.offload_optimizer.nvme_path: /proc/loom-nvme is not an existing folder" \
  "$WORK/out4.txt" || fail "no nvme_path message: $(cat "$WORK/out4.txt")"
[[ ! -e "$WORK/d" ]] || fail "run folder created despite the config error"
echo "ok: nvme_path error under mpirun"
rc=0
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set train_batch_size=7 \
  --out "$WORK/c" > "$WORK/out3.txt" 2>&1 || rc=$?
((rc != 0)) || fail "bad batch accepted"
grep -q "train_batch_size 7 is not divisible by the data-parallel size 2" "$WORK/out3.txt" ||
  fail "no batch message: $(cat "$WORK/out3.txt")"
echo "ok: config error under mpirun"
# 1-bit Adam from the CLI: the switch logged on the first compressed step,
# metrics with the phase and 1/32 of the bytes; a freeze_step beyond the run
# warns; expert parallelism is refused naming the key.
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set optimizer.type=OneBitAdam \
  --set optimizer.params.freeze_step=3 --out "$WORK/onebit" > "$WORK/out-onebit.txt" 2>&1 ||
  fail "OneBitAdam training failed: $(cat "$WORK/out-onebit.txt")"
grep -q "loom: step 4: OneBitAdam compresses from here on (variance frozen)" "$WORK/out-onebit.txt" ||
  fail "no switch line: $(cat "$WORK/out-onebit.txt")"
python3 - "$WORK/onebit" <<'PY' || fail "OneBitAdam metrics"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
phases = [l["compression"]["phase"] for l in lines]
assert phases == ["warmup"] * 3 + ["compressed"] * 3, phases
for l in lines[3:]:
    c = l["compression"]
    assert c["type"] == "OneBitAdam" and c["ratio"] > 25 and c["error_norm"] > 0, c
    assert l["comm_bytes"] < lines[0]["comm_bytes"] / 20, (l["comm_bytes"], lines[0]["comm_bytes"])
print("ok: OneBitAdam metrics", lines[-1]["compression"])
PY
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set optimizer.type=OneBitAdam \
  --out "$WORK/onebit-never" > "$WORK/out-never.txt" 2>&1 || fail "OneBitAdam (never compressing) failed"
grep -q "warning: optimizer.params.freeze_step 100000 >= train.steps 6: compression never starts" \
  "$WORK/out-never.txt" || fail "no freeze_step warning: $(cat "$WORK/out-never.txt")"
rc=0
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set optimizer.type=OneBitAdam \
  --set model.moe.num_experts=2 --set parallel.expert=2 --out "$WORK/onebit-ep" \
  > "$WORK/out-onebit-ep.txt" 2>&1 || rc=$?
((rc != 0)) || fail "OneBitAdam with expert parallelism accepted"
grep -q "optimizer.type OneBitAdam with parallel.expert 2: expert units reduce over their own groups" \
  "$WORK/out-onebit-ep.txt" || fail "no expert-parallel message: $(cat "$WORK/out-onebit-ep.txt")"
echo "ok: OneBitAdam under mpirun"
echo PASS
