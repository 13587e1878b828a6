#!/usr/bin/env bash
# Checkpoints as a user meets them: the safetensors layout read by an
# independent parser, bitwise-exact resume, generate from a checkpoint, and
# kill -9 during saves never damaging an earlier checkpoint.
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

# The safetensors layout, read with nothing but the format's definition.
python3 - "$WORK/a/checkpoints/step-00000010/model.safetensors" <<'PY' || fail "safetensors layout"
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

# Resume from step 8 into another folder: steps 9 and 10 are bitwise equal.
"$LOOM" train --config "$WORK/cfg.json" --out "$WORK/b" --resume "$WORK/a/checkpoints/step-00000008" > "$WORK/resume.txt"
grep -q "resumed from .* at step 8" "$WORK/resume.txt" || fail "no resume line"
python3 - "$WORK/a/metrics.jsonl" "$WORK/b/metrics.jsonl" <<'PY' || fail "resume is not exact"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert [l["step"] for l in b] == [9, 10], b
for x, y in zip(a[8:], b):
    assert x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"] and x["lr"] == y["lr"], (x, y)
print("ok: resumed losses", [l["loss"] for l in b])
PY
# --resume latest in the same folder continues past the old end.
"$LOOM" train --config "$WORK/cfg.json" --set train.steps=12 --out "$WORK/a" --resume latest >/dev/null
json_check "$WORK/a/metrics.jsonl" '[l["step"] for l in lines] == list(range(1, 13))'

"$LOOM" generate --checkpoint "$WORK/a/checkpoints/step-00000012" --prompt "fortune" \
  --max-tokens 30 --temperature 0 > "$WORK/gen.txt"
[[ $(head -c 7 "$WORK/gen.txt") == fortune && $(wc -c < "$WORK/gen.txt") -ge 37 ]] || fail "generate: $(cat "$WORK/gen.txt")"
echo "ok: generate"
expect_error "'transformer.wte.weight' has shape [256,32] but the config needs [256,64]" "$LOOM" train --config "$WORK/cfg.json" --set model.n_embd=64 \
  --out "$WORK/c" --resume "$WORK/a/checkpoints/step-00000012"
expect_error "--resume latest: no checkpoint in $WORK/none/checkpoints" \
  "$LOOM" train --config "$WORK/cfg.json" --out "$WORK/none" --resume latest

# --init-from: a new run starts from the trained weights (Hugging Face layout).
"$LOOM" train --config "$WORK/cfg.json" --set train.steps=1 --set checkpoint.every=0 \
  --out "$WORK/init" --init-from "$WORK/a/checkpoints/step-00000012/model.safetensors" >/dev/null
python3 - "$WORK/a/metrics.jsonl" "$WORK/init/metrics.jsonl" <<'PY' || fail "--init-from did not load the weights"
import json, sys
trained = [json.loads(l) for l in open(sys.argv[1])][-1]["loss"]
first = [json.loads(l) for l in open(sys.argv[2])][0]["loss"]
assert first < trained + 0.5 and first < 5.0, (first, trained)
print(f"ok: --init-from first loss {first:.3f} (trained run ended at {trained:.3f})")
PY
expect_error "the file has model.n_layer 2 but the config's model.n_layer is 3" \
  "$LOOM" train --config "$WORK/cfg.json" --set model.n_layer=3 --out "$WORK/init3" \
  --init-from "$WORK/a/checkpoints/step-00000012/model.safetensors"
head -c 100 "$WORK/a/checkpoints/step-00000012/model.safetensors" > "$WORK/cut.safetensors"
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
echo PASS
