#!/usr/bin/env bash
# loom plan: a 1T-parameter model on 3072 A100s in well under a second, the
# --json contract scripts rely on (layout, step_time_s, tokens_per_s,
# tflops_per_gpu, mem_bytes by category), --layout fixing what it names,
# and bad input in one line.
source "$(dirname "$0")/lib.sh"
here=$(cd "$(dirname "$0")" && pwd)
root="$here/../.."
"$LOOM" plan --model "$root/configs/models/megatron-1t.json" --cluster "$root/configs/clusters/selene-a100.json" \
  --gpus 3072 --global-batch 3072 --top 5 > "$WORK/table.txt" || fail "plan: $(cat "$WORK/table.txt")"
grep -q "^1    8 " "$WORK/table.txt" || fail "no ranked table: $(cat "$WORK/table.txt")"
python3 - "$WORK/table.txt" <<'PY' || fail "plan took too long: $(tail -1 "$WORK/table.txt")"
import re, sys
m = re.search(r"(\d+) layouts estimated in ([0-9.]+) s", open(sys.argv[1]).read())
assert m and int(m.group(1)) > 1000 and float(m.group(2)) < 5, m and m.groups()
PY
"$LOOM" plan --model "$root/configs/models/megatron-1t.json" --cluster "$root/configs/clusters/selene-a100.json" \
  --gpus 3072 --global-batch 3072 --layout tp=8,pp=64,recompute=full --json > "$WORK/plan.jsonl"
python3 - "$WORK/plan.jsonl" <<'PY' || fail "plan --json"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert 0 < len(rows) <= 10, len(rows)
best = None
for r in rows:
    assert {"layout", "step_time_s", "tokens_per_s", "tflops_per_gpu", "mem_bytes"} <= r.keys(), r.keys()
    l = r["layout"]
    assert l["tp"] == 8 and l["pp"] == 64 and l["recompute"] == "full" and l["tp"] * l["pp"] * l["dp"] * l["cp"] == 3072, l
    m = r["mem_bytes"]
    assert abs(sum(m[k] for k in ("params", "grads", "optimizer", "activations", "comm", "workspace")) - m["total"]) < 1, m
    assert m["total"] <= 85899345920 - 3e9 and r["step_time_s"] > 0, r
    assert best is None or r["tokens_per_s"] <= best
    best = r["tokens_per_s"]
print("ok: plan --json,", len(rows), "layouts")
PY
expect_error "$root/configs/clusters/nothing.json" "$LOOM" plan --model "$root/configs/models/megatron-1t.json" \
  --cluster "$root/configs/clusters/nothing.json" --gpus 8 --global-batch 8
echo '{"gpus_per_node": 8, "gpu": {"memory_bytes": -1}}' > "$WORK/bad.json"
expect_error "$WORK/bad.json: gpu.memory_bytes must be > 0, not -1" "$LOOM" plan \
  --model "$root/configs/models/megatron-1t.json" --cluster "$WORK/bad.json" --gpus 8 --global-batch 8
expect_error "the model fits on no layout of 8 x A100-SXM4-80GB" "$LOOM" plan \
  --model "$root/configs/models/megatron-1t.json" --cluster "$root/configs/clusters/selene-a100.json" --gpus 8 --global-batch 8
expect_error "--layout: unknown key 'tq'" "$LOOM" plan --model "$root/configs/models/megatron-1t.json" \
  --cluster "$root/configs/clusters/selene-a100.json" --gpus 8 --global-batch 8 --layout tq=2

# --calibrate: this host as a cluster file the planner reads; under mpirun
# the link between two ranks of the host is measured.
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$LOOM" plan --calibrate "$WORK/one.json" --model "$root/configs/bench/gpt-s.json" > "$WORK/cal1.txt" ||
  fail "calibrate: $(cat "$WORK/cal1.txt")"
grep -q "(one rank: not measured)" "$WORK/cal1.txt" || fail "one rank: $(cat "$WORK/cal1.txt")"
mpirun --oversubscribe -np 2 "$LOOM" plan --calibrate "$WORK/two.json" --model "$root/configs/bench/gpt-s.json" \
  > "$WORK/cal2.txt" 2>&1 || fail "calibrate under mpirun: $(cat "$WORK/cal2.txt")"
json_check "$WORK/two.json" 'd["measured"]["node_link"] and d["gpus_per_node"] == 2 and d["links"]["node"]["latency_us"] > 0 and len(d["measured"]["sgemm"]) >= 9 and 0 < d["gpu"]["gemm_efficiency"]["max"] <= 1'
"$LOOM" plan --model "$root/configs/bench/gpt-s.json" --cluster "$WORK/two.json" --gpus 2 --global-batch 8 \
  --top 3 > "$WORK/here.txt" || fail "planning on the calibrated host: $(cat "$WORK/here.txt")"
grep -q "^1 " "$WORK/here.txt" || fail "no layout on the calibrated host: $(cat "$WORK/here.txt")"
# loom tune: the plan's best kinds of layout trained for two steps each on
# two ranks, the fastest written as a config that trains.
mpirun --oversubscribe -np 2 "$LOOM" tune --config "$root/configs/bench/gpt-s.json" --cluster "$WORK/two.json" \
  --set model.n_layer=2 --set model.n_embd=64 --top 3 --steps 2 --out "$WORK/tuned.json" > "$WORK/tune.txt" 2>&1 ||
  fail "tune: $(tail -20 "$WORK/tune.txt")"
grep -q "<- fastest" "$WORK/tune.txt" || fail "no table: $(cat "$WORK/tune.txt")"
[[ $(grep -c "^loom: tune [0-9]/3 " "$WORK/tune.txt") -eq 3 ]] || fail "not 3 candidates: $(cat "$WORK/tune.txt")"
json_check "$WORK/tuned.json" 'd["model"]["n_layer"] == 2 and "tensor" in d["parallel"] and d["train_micro_batch_size_per_gpu"] * d["gradient_accumulation_steps"] * 2 // (d["parallel"]["tensor"] * d["parallel"]["pipeline"]) == 32'
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/tuned.json" --set train.steps=1 --out "$WORK/tuned-run" \
  > "$WORK/tuned-run.txt" 2>&1 || fail "tuned.json does not train: $(tail -5 "$WORK/tuned-run.txt")"
expect_error "loom plan: --cluster is required (or --calibrate FILE)" "$LOOM" plan --model "$root/configs/bench/gpt-s.json"
echo "plan: ok"
