#!/usr/bin/env bash
# log.profile: a 2-stage pipeline cut [1, 5] gets a per-layer profile of
# every piece on both ranks, per-step imbalance in metrics.jsonl, and a
# load-imbalance report naming the slow stage with a partition that moves
# blocks; the run with that partition is balanced. A data-parallel run is
# profiled and traced (compute and communication on one axis per rank).
source "$(dirname "$0")/lib.sh"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

mkdir -p "$WORK/text"
for i in $(seq 1 200); do echo "line $i: the quick brown fox jumps over the lazy dog."; done > "$WORK/text/a.txt"
"$LOOM" prepare-data --input "$WORK/text" --tokenizer byte --val-fraction 0.1 --out "$WORK/data" >/dev/null
cat > "$WORK/cfg.json" <<JSON
{"train_batch_size": 8, "gradient_accumulation_steps": 4,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
 "model": {"n_layer": 6, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32},
 "data": {"train": "$WORK/data/train.bin"},
 "train": {"steps": 8},
 "log": {"every": 4, "profile": true}}
JSON

run_pipeline() {  # name partition
  mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set parallel.pipeline=2 \
    --set "parallel.partition=$2" --out "$WORK/$1" > "$WORK/$1.txt" 2>&1 ||
    fail "training $1: $(tail -20 "$WORK/$1.txt")"
  grep -q "loom: profile (log.profile) in $WORK/$1/profile.txt" "$WORK/$1.txt" ||
    fail "no profile printed: $(tail -20 "$WORK/$1.txt")"
  grep -q "load imbalance over 2 ranks" "$WORK/$1.txt" || fail "no imbalance report printed"
}

run_pipeline skewed "[1, 5]"
python3 - "$WORK/skewed" <<'PY' > "$WORK/suggested" || fail "skewed profile: $(cat "$WORK/skewed.txt")"
import json, re, sys
run = sys.argv[1]
p = json.load(open(run + "/profile.json"))
assert p["shape"]["pp"] == 2 and p["shape"]["partition"] == [1, 5] and p["shape"]["steps"] == 7, p["shape"]
names = [[q["name"] for c in r["chunks"] for q in c["pieces"]] for r in p["ranks"]]
assert names == [["embeddings", "h.0"], ["h.1", "h.2", "h.3", "h.4", "h.5", "ln_f", "lm_head"]], names
for r in p["ranks"]:
    for c in r["chunks"]:
        for q in c["pieces"]:
            assert q["forward_s"] > 0 and q["backward_s"] > 0, q
            assert (q["flops"] > 0) == (q["name"].startswith("h.") or q["name"] == "lm_head"), q
            assert q["bytes"] > 0 and (q["record_bytes"] > 0 or q["name"] == "ln_f"), q
    # The pieces are the compute: inside the step.
    assert 0 < r["compute_s"] < r["step_s"], r
    assert r["mem_peak_bytes"]["activations"] > 0 and r["comm_bytes"] > 0, r
compute = p["imbalance"][0]
assert compute["kind"] == "compute" and compute["rank"] == 1 and compute["imbalance"] > 0.3, compute
m = re.search(r"parallel\.partition \[(\d+), (\d+)\] \(h\.1(-h\.\d+)? from stage 1 to stage 0\)",
              compute["suggestion"])
assert m, compute
assert [k["kind"] for k in p["imbalance"]] == ["compute", "memory", "communication"]
# Every metrics line: the step's imbalance, the slow stage named.
lines = [json.loads(l) for l in open(run + "/metrics.jsonl")]
assert all(l["imbalance"]["compute_rank"] == 1 for l in lines[1:]), [l["imbalance"] for l in lines]
text = open(run + "/profile.txt").read()
for s in ["h.5", "lm_head", "peak memory per rank", "collectives per rank and step", "load imbalance"]:
    assert s in text, s
print(json.dumps([int(m.group(1)), int(m.group(2))], separators=(",", ":")), compute["imbalance"])
PY
read -r cut before < "$WORK/suggested"
echo "skewed [1, 5]: compute imbalance $before; suggested $cut"

run_pipeline balanced "$cut"
python3 - "$WORK/balanced/profile.json" "$before" <<'PY' || fail "the suggested cut is not balanced: $(cat "$WORK/balanced.txt")"
import json, sys
p = json.load(open(sys.argv[1]))
after = p["imbalance"][0]["imbalance"]
print("suggested cut: compute imbalance", after)
assert after < float(sys.argv[2]) / 2, (after, sys.argv[2])
PY

# Data parallel: profiled and traced.
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set parallel.data=2 \
  --set zero_optimization.stage=2 --set log.trace=true --out "$WORK/dp" > "$WORK/dp.txt" 2>&1 ||
  fail "training dp: $(tail -20 "$WORK/dp.txt")"
json_check "$WORK/dp/profile.json" 'len(d["ranks"]) == 2 and d["shape"]["dp"] == 2 and all(any(c["kind"] == "reducescatter" for c in r["comm"]) for r in d["ranks"])'
python3 - "$WORK/dp/trace.json" <<'PY' || fail "dp trace"
import json, sys
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e["ph"] == "X"]
for pid in (0, 1):
    cats = {e["cat"] for e in ev if e["pid"] == pid}
    assert {"compute", "comm"} <= cats, (pid, cats)
print("ok: dp trace", len(ev), "events")
PY

# Tensor parallel: each block's collectives (its regions' all-reduces) are
# counted in its row, from the record: every block sent bytes, and the
# pieces' bytes add up to what the rank sent (all of it issued inside a
# piece, but for a few words) and never past what the rank sent.
mpirun --oversubscribe -np 2 "$LOOM" train --config "$WORK/cfg.json" --set parallel.tensor=2 \
  --out "$WORK/tp" > "$WORK/tp.txt" 2>&1 || fail "training tp: $(tail -20 "$WORK/tp.txt")"
python3 - "$WORK/tp/profile.json" <<'PY' || fail "tp profile: $(cat "$WORK/tp/profile.txt")"
import json, sys
p = json.load(open(sys.argv[1]))
for r in p["ranks"]:
    pieces = [q for c in r["chunks"] for q in c["pieces"]]
    assert all(q["comm_bytes"] > 0 for q in pieces if q["name"].startswith("h.")), pieces
    total = sum(q["comm_bytes"] for q in pieces)
    # Outside every piece: the loss's and the gradient norm's few words.
    assert 0.99 * r["comm_bytes"] <= total <= r["comm_bytes"] * 1.001, (total, r["comm_bytes"], r["comm"])
print("ok: tp per-layer bytes", [round(q["comm_bytes"]) for c in p["ranks"][0]["chunks"] for q in c["pieces"]])
PY
grep -q "comm MB" "$WORK/tp/profile.txt" || fail "no comm MB column: $(head -5 "$WORK/tp/profile.txt")"

# One process: the table and the report, no imbalance in the metrics.
"$LOOM" train --config "$WORK/cfg.json" --set train.steps=3 --out "$WORK/one" > "$WORK/one.txt" 2>&1 ||
  fail "training one: $(tail -20 "$WORK/one.txt")"
grep -q "load imbalance over 1 rank " "$WORK/one.txt" || fail "one rank: $(cat "$WORK/one.txt")"
json_check "$WORK/one/metrics.jsonl" 'all("imbalance" not in l for l in lines)'
# One process computes most of its step: the pieces' times are the step's.
json_check "$WORK/one/profile.json" 'd["shape"]["steps"] == 2 and 0.6 < d["ranks"][0]["compute_s"] / d["ranks"][0]["step_s"] < 1'
echo "profile: ok"
