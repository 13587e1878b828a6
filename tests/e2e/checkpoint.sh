#!/usr/bin/env bash
# Checkpoints as a user meets them: the sharded layout and the consolidated
# Hugging Face file read by an independent parser, bitwise-exact resume from
# either, generate from a checkpoint, and kill -9 during saves never
# damaging an earlier checkpoint.
source "$(dirname "$0")/lib.sh"

mkdir -p "$WORK/text"
for i in $(seq 1 300); do echo "fortune $i: a penny saved is a penny earned, said the cat."; done > "$WORK/text/a.txt"
"$LOOM" prepare-data --input "$WORK/text" --val-fraction 0.1 --out "$WORK/data" >/dev/null

cat > "$WORK/cfg.json" <<JSON
{"train_batch_size": 4, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
 "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "total_num_steps": 10}},
 "model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "seq_len": 32, "dropout": 0.1},
 "data": {"train": "$WORK/data/train.bin", "val": "$WORK/data/val.bin"},
 "train": {"steps": 10, "seed": 5},
 "checkpoint": {"every": 4, "keep_last": 2},
 "log": {"peak_gflops": 100}}
JSON
"$LOOM" train --config "$WORK/cfg.json" --out "$WORK/a" >/dev/null
ls "$WORK/a/checkpoints" > "$WORK/ls.txt"
[[ $(tr '\n' ' ' < "$WORK/ls.txt") == "latest step-00000008 step-00000010 " ]] || fail "keep_last: $(cat "$WORK/ls.txt")"
[[ $(cat "$WORK/a/checkpoints/latest") == step-00000010 ]] || fail "latest pointer"

# The sharded layout, read with nothing but the formats' definitions: one
# file per rank, the manifest naming every tensor's shape and pieces.
python3 - "$WORK/a/checkpoints/step-00000010" <<'PY' || fail "sharded layout"
import json, struct, sys, os, hashlib
d = sys.argv[1]
m = json.load(open(os.path.join(d, "manifest.json")))
assert m["format"] == "loom checkpoint v2" and m["step"] == 10, m["format"]
assert set(m["files"]) == {"rank-00000.safetensors", "trainer_state.json", "config.resolved.json"}, m["files"]
for f, info in m["files"].items():
    raw = open(os.path.join(d, f), "rb").read()
    assert len(raw) == info["bytes"] and hashlib.sha256(raw).hexdigest() == info["sha256"], f
raw = open(os.path.join(d, "rank-00000.safetensors"), "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
meta = header.pop("__metadata__")
assert meta["format"] == "loom shard v1", meta
params = [t for t in m["tensors"] if not t.startswith("exp_avg")]
assert len(params) == 4 + 2 * 12 and "transformer.h.1.mlp.c_proj.weight" in params, params
assert m["tensors"]["transformer.wte.weight"]["shape"][1] == 32
for t, info in m["tensors"].items():
    count = 1
    for x in info["shape"]:
        count *= x
    (piece,) = info["pieces"]  # one process: each tensor whole in one piece
    assert piece["file"] == "rank-00000.safetensors" and piece["range"] == [0, count], (t, piece)
    assert header[t]["shape"] == [count] and header[t]["dtype"] == "F32", t
assert set(header) == set(m["tensors"])
print("ok: sharded layout,", len(m["tensors"]), "tensors")
PY

# Consolidated into a whole checkpoint: Hugging Face's layout, read with
# nothing but the format's definition.
"$LOOM" checkpoint consolidate "$WORK/a/checkpoints" --out "$WORK/cons10" > "$WORK/cons.txt"
grep -q "consolidated .*step-00000010 into $WORK/cons10" "$WORK/cons.txt" || fail "consolidate: $(cat "$WORK/cons.txt")"
"$LOOM" checkpoint verify "$WORK/cons10" | grep -q "every file matches" || fail "verify consolidated"
expect_error "cons10: already exists" "$LOOM" checkpoint consolidate "$WORK/a/checkpoints/step-00000010" --out "$WORK/cons10"
python3 - "$WORK/cons10/model.safetensors" <<'PY' || fail "safetensors layout"
import json, struct, sys, os
path = sys.argv[1]
raw = open(path, "rb").read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
data = len(raw) - 8 - n
meta = header.pop("__metadata__")
assert meta == {"format": "pt"}, meta
want = {"transformer.wte.weight": [256, 32], "transformer.wpe.weight": [32, 32],
        "lm_head.weight": [256, 32], "transformer.ln_f.weight": [32], "transformer.ln_f.bias": [32]}
for l in range(2):
    h = f"transformer.h.{l}."
    want.update({h + "ln_1.weight": [32], h + "ln_1.bias": [32],
                 h + "attn.c_attn.weight": [32, 96], h + "attn.c_attn.bias": [96],
                 h + "attn.c_proj.weight": [32, 32], h + "attn.c_proj.bias": [32],
                 h + "ln_2.weight": [32], h + "ln_2.bias": [32],
                 h + "mlp.c_fc.weight": [32, 128], h + "mlp.c_fc.bias": [128],
                 h + "mlp.c_proj.weight": [128, 32], h + "mlp.c_proj.bias": [32]})
assert set(header) == set(want), set(header) ^ set(want)
spans = []
for name, e in header.items():
    assert e["dtype"] == "F32" and e["shape"] == want[name], (name, e)
    b, end = e["data_offsets"]
    count = 1
    for d in e["shape"]:
        count *= d
    assert end - b == 4 * count, name
    spans.append((b, end))
spans.sort()
assert spans[0][0] == 0 and spans[-1][1] == data
assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "gaps or overlaps"
wte = raw[8 + n + header["transformer.wte.weight"]["data_offsets"][0]:][:256 * 32 * 4]
head = raw[8 + n + header["lm_head.weight"]["data_offsets"][0]:][:256 * 32 * 4]
assert wte == head, "lm_head.weight must equal the tied wte"
print("ok: safetensors layout")
PY

# Resume from step 8 into another folder: steps 9 and 10 are bitwise equal,
# from the sharded checkpoint, from it consolidated, and from a run that
# saved whole checkpoints directly.
"$LOOM" checkpoint consolidate "$WORK/a/checkpoints/step-00000008" --out "$WORK/cons8" >/dev/null
"$LOOM" train --config "$WORK/cfg.json" --set checkpoint.format=whole --out "$WORK/w" >/dev/null
[[ -f "$WORK/w/checkpoints/step-00000008/model.safetensors" ]] || fail "checkpoint.format whole"
for from in a/checkpoints/step-00000008 cons8 w/checkpoints/step-00000008; do
  rm -rf "$WORK/b"
  "$LOOM" train --config "$WORK/cfg.json" --out "$WORK/b" --resume "$WORK/$from" > "$WORK/resume.txt"
  grep -q "resumed from .* at step 8" "$WORK/resume.txt" || fail "no resume line"
  python3 - "$WORK/a/metrics.jsonl" "$WORK/b/metrics.jsonl" <<'PY' || fail "resume from $from is not exact"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert [l["step"] for l in b] == [9, 10], b
for x, y in zip(a[8:], b):
    assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"] and x["lr"] == y["lr"], (x, y)
print("ok: resumed losses", [l["loss"] for l in b])
PY
done
# --resume latest in the same folder continues past the old end.
"$LOOM" train --config "$WORK/cfg.json" --set train.steps=12 --out "$WORK/a" --resume latest >/dev/null
json_check "$WORK/a/metrics.jsonl" '[l["step"] for l in lines] == list(range(1, 13))'

"$LOOM" generate --checkpoint "$WORK/a/checkpoints/step-00000012" --prompt "fortune" \
  --max-tokens 30 --temperature 0 > "$WORK/gen.txt"
[[ $(head -c 7 "$WORK/gen.txt") == fortune && $(wc -c < "$WORK/gen.txt") -ge 37 ]] || fail "generate: $(cat "$WORK/gen.txt")"
echo "ok: generate"
expect_error "step-00000012: saved with model.n_embd 32 but the config has 64" "$LOOM" train --config "$WORK/cfg.json" --set model.n_embd=64 \
  --out "$WORK/c" --resume "$WORK/a/checkpoints/step-00000012"
expect_error "--resume latest: no checkpoint in $WORK/none/checkpoints" \
  "$LOOM" train --config "$WORK/cfg.json" --out "$WORK/none" --resume latest

# --init-from: a new run starts from the trained weights (Hugging Face layout).
"$LOOM" checkpoint consolidate "$WORK/a/checkpoints/step-00000012" --out "$WORK/cons12" >/dev/null
"$LOOM" train --config "$WORK/cfg.json" --set train.steps=1 --set checkpoint.every=0 \
  --out "$WORK/init" --init-from "$WORK/cons12/model.safetensors" >/dev/null
python3 - "$WORK/a/metrics.jsonl" "$WORK/init/metrics.jsonl" <<'PY' || fail "--init-from did not load the weights"
import json, sys
trained = [json.loads(l) for l in open(sys.argv[1])][-1]["loss"]
first = [json.loads(l) for l in open(sys.argv[2])][0]["loss"]
assert first < trained + 0.5 and first < 5.0, (first, trained)
print(f"ok: --init-from first loss {first:.3f} (trained run ended at {trained:.3f})")
PY
expect_error "the file has model.n_layer 2 but the config's model.n_layer is 3" \
  "$LOOM" train --config "$WORK/cfg.json" --set model.n_layer=3 --out "$WORK/init3" \
  --init-from "$WORK/cons12/model.safetensors"
head -c 100 "$WORK/cons12/model.safetensors" > "$WORK/cut.safetensors"
expect_error "cut.safetensors: header length" \
  "$LOOM" train --config "$WORK/cfg.json" --out "$WORK/init4" --init-from "$WORK/cut.safetensors"

# kill -9 at arbitrary moments of a run that saves every step: every complete
# checkpoint still verifies, and the run resumes from the latest.
cat > "$WORK/big.json" <<JSON
{"train_batch_size": 2,
 "model": {"n_layer": 4, "n_embd": 384, "n_head": 6, "vocab_size": 256, "seq_len": 32},
 "data": {"train": "$WORK/data/train.bin"},
 "train": {"steps": 1000, "seed": 5}, "checkpoint": {"every": 1, "keep_last": 3},
 "log": {"peak_gflops": 100}}
JSON
shopt -s nullglob
for delay in 0.3 0.7 1.3 0.9 1.7 1.1; do
  resume=()
  [[ -f "$WORK/k/checkpoints/latest" ]] && resume=(--resume latest)
  "$LOOM" train --config "$WORK/big.json" --out "$WORK/k" --overwrite "${resume[@]}" >/dev/null &
  pid=$!
  # The first run lives until its first checkpoint exists, so later runs resume.
  for _ in $(seq 600); do [[ -f "$WORK/k/checkpoints/latest" ]] && break; sleep 0.1; done
  sleep "$delay"
  kill -9 "$pid"
  wait "$pid" 2>/dev/null || true
  for d in "$WORK"/k/checkpoints/step-*; do
    "$LOOM" generate --checkpoint "$d" --prompt x --max-tokens 1 >/dev/null ||
      fail "checkpoint $d damaged after kill -9"
  done
done
ls -a "$WORK/k/checkpoints"
[[ -f "$WORK/k/checkpoints/latest" ]] || fail "no checkpoint survived"
"$LOOM" train --config "$WORK/big.json" --out "$WORK/k" --resume latest \
  --set train.steps=$(( $(sed 's/step-0*//' "$WORK/k/checkpoints/latest") + 1 )) >/dev/null
echo "ok: kill -9 during saves"

# Crashes injected at each phase of a save (LOOM_TEST_FAULT=PHASE@STEP kills
# the process there): the previous checkpoint stays intact and `latest`
# names a complete one; resuming from it gives bitwise the losses of a run
# never interrupted.
cat > "$WORK/fault.json" <<JSON
{"train_batch_size": 4, "model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "seq_len": 32, "dropout": 0.1},
 "data": {"train": "$WORK/data/train.bin"}, "train": {"steps": 5, "seed": 5},
 "checkpoint": {"every": 1, "keep_last": 2}, "log": {"peak_gflops": 100}}
JSON
"$LOOM" train --config "$WORK/fault.json" --out "$WORK/f-ref" >/dev/null
for phase in partial rename pointer; do
  rc=0
  LOOM_TEST_FAULT=$phase@3 "$LOOM" train --config "$WORK/fault.json" --out "$WORK/f-$phase" \
    >/dev/null 2>&1 || rc=$?
  ((rc == 137)) || fail "$phase: the injected crash did not happen (exit $rc)"
  # At `pointer` step 3 is complete in place, but latest has not moved yet.
  latest=$(cat "$WORK/f-$phase/checkpoints/latest")
  [[ $latest == step-00000002 ]] || fail "$phase: latest is $latest, expected step-00000002"
  "$LOOM" generate --checkpoint "$WORK/f-$phase/checkpoints/step-00000002" --prompt x \
    --max-tokens 1 >/dev/null || fail "$phase: step 2 damaged"
  "$LOOM" train --config "$WORK/fault.json" --out "$WORK/f-$phase" --resume latest >/dev/null ||
    fail "$phase: resume from latest"
  python3 - "$WORK/f-ref/metrics.jsonl" "$WORK/f-$phase/metrics.jsonl" <<'PY' || fail "$phase: resume not exact"
import json, sys
ref, got = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert [l["step"] for l in got] == [1, 2, 3, 4, 5], got
assert [l["loss"] for l in got] == [l["loss"] for l in ref], (got, ref)
PY
done
echo "ok: crashes injected at every save phase leave latest complete and resume bitwise"

# Non-finite gradients (LOOM_TEST_NONFINITE=STEP:PARAM puts a NaN into that
# parameter's gradient): train.on_nonfinite stop ends the run naming the
# step and the parameter; skip counts the step and goes on, and a run
# resumed after the skip continues bitwise (the skip count is in the
# checkpoint: the schedule and AdamW's bias correction depend on it).
rc=0
LOOM_TEST_NONFINITE=3:transformer.h.1.mlp.c_fc.weight "$LOOM" train --config "$WORK/fault.json" \
  --out "$WORK/nf-stop" > "$WORK/nf.txt" 2>&1 || rc=$?
((rc == 1)) || fail "non-finite stop: exit $rc"
grep -Eq "loom: error: step 3: non-finite gradient \(norm -?nan\) first in 'transformer.h.1.mlp.c_fc.weight' \(in the model's parameter order\); stopping here" \
  "$WORK/nf.txt" || fail "non-finite stop message: $(cat "$WORK/nf.txt")"
json_check "$WORK/nf-stop/metrics.jsonl" '[l["step"] for l in lines] == [1, 2]'
LOOM_TEST_NONFINITE=3:transformer.wpe.weight "$LOOM" train --config "$WORK/fault.json" \
  --set train.on_nonfinite=skip --out "$WORK/nf-skip" > "$WORK/nf2.txt"
grep -q "loom: step 3 skipped: non-finite gradient first in 'transformer.wpe.weight' (1 skipped so far)" \
  "$WORK/nf2.txt" || fail "no skip line: $(cat "$WORK/nf2.txt")"
grep -q "loom: 1 steps skipped for non-finite gradients" "$WORK/nf2.txt" || fail "no skip summary"
json_check "$WORK/nf-skip/metrics.jsonl" '[l["skipped_steps"] for l in lines] == [0, 0, 1, 1, 1]'
"$LOOM" train --config "$WORK/fault.json" --set train.on_nonfinite=skip --out "$WORK/nf-r" \
  --resume "$WORK/nf-skip/checkpoints/step-00000004" > /dev/null
python3 - "$WORK/nf-skip/metrics.jsonl" "$WORK/nf-r/metrics.jsonl" <<'PY' || fail "resume after a skipped step is not exact"
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert [l["step"] for l in b] == [5] and b[0]["skipped_steps"] == 1, b
assert b[0]["loss"] == a[4]["loss"] and b[0]["lr"] == a[4]["lr"], (a[4], b[0])
PY
echo "ok: non-finite gradients stop naming the parameter, or are skipped and resume bitwise"

# A mixture-of-experts model: every expert under its own name in the
# checkpoint, a resume bitwise, generation from it, and its load metrics.
moe=(--set 'model.moe={"num_experts": 4, "top_k": 2, "every_n_layers": 2, "capacity_factor": 1.25}')
"$LOOM" train --config "$WORK/fault.json" "${moe[@]}" --out "$WORK/moe" > "$WORK/moe.txt"
grep -q "loom: mixture of experts in blocks 1: 4 experts, top-2, learned router, capacity factor 1.25" "$WORK/moe.txt" ||
  fail "no MoE line: $(cat "$WORK/moe.txt")"
grep -q "loom: mixture of experts at the last step: worst load imbalance" "$WORK/moe.txt" || fail "no MoE summary"
python3 - "$WORK/moe" <<'PY' || fail "MoE checkpoint or metrics"
import json, sys
d = sys.argv[1]
m = json.load(open(d + "/checkpoints/step-00000005/manifest.json"))
names = set(m["tensors"])
for e in range(4):
    assert f"transformer.h.1.mlp.experts.{e}.c_fc.weight" in names, sorted(names)
assert "transformer.h.1.mlp.router.weight" in names and "transformer.h.0.mlp.c_fc.weight" in names
lines = [json.loads(l) for l in open(d + "/metrics.jsonl")]
for l in lines:
    (layer,) = l["moe"]
    assert layer["layer"] == 1 and layer["imbalance"] >= 1 and 0 <= layer["dropped"] < 1, layer
PY
"$LOOM" train --config "$WORK/fault.json" "${moe[@]}" --out "$WORK/moe-r" \
  --resume "$WORK/moe/checkpoints/step-00000004" > /dev/null
python3 - "$WORK/moe/metrics.jsonl" "$WORK/moe-r/metrics.jsonl" <<'PY' || fail "MoE resume is not exact"
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
assert [l["step"] for l in b] == [5] and b[0]["loss"] == a[4]["loss"], (a[4], b)
PY
"$LOOM" generate --checkpoint "$WORK/moe/checkpoints/step-00000005" --prompt fortune --max-tokens 5 \
  --temperature 0 > "$WORK/moe-gen.txt" || fail "generate from a MoE checkpoint"
"$LOOM" checkpoint consolidate "$WORK/moe/checkpoints" --out "$WORK/moe-cons" > /dev/null ||
  fail "consolidate a MoE checkpoint"
expect_error "saved with model.moe.num_experts 4 but the config has 8" "$LOOM" train \
  --config "$WORK/fault.json" --set 'model.moe={"num_experts": 8, "every_n_layers": 2}' \
  --out "$WORK/moe-bad" --resume "$WORK/moe/checkpoints/step-00000004"
echo "ok: mixture of experts: experts by name in the checkpoint, resume bitwise, generate, consolidate, load metrics"
echo PASS
