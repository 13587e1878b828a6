#!/usr/bin/env bash
# A short run writes the output contract: metrics.jsonl with every field per
# step, config.resolved.json; bench commands print their JSON.
source "$(dirname "$0")/lib.sh"

mkdir -p "$WORK/text"
for i in $(seq 1 200); do echo "line $i: the quick brown fox jumps over the lazy dog."; done > "$WORK/text/a.txt"
"$LOOM" prepare-data --input "$WORK/text" --tokenizer byte --val-fraction 0.2 --out "$WORK/data" > "$WORK/prep.txt"
grep -q "train + .* val tokens" "$WORK/prep.txt" || fail "prepare-data summary"
json_check "$WORK/data/meta.json" 'd["tokenizer"] == "byte" and d["vocab_size"] == 256 and d["train_tokens"] + d["val_tokens"] == d["sources"][0]["bytes"] and len(d["sources"][0]["sha256"]) == 64'

cat > "$WORK/cfg.json" <<JSON
{"train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
 "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 3e-3, "total_num_steps": 12}},
 "model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "seq_len": 32, "dropout": 0.1},
 "data": {"train": "$WORK/data/train.bin", "val": "$WORK/data/val.bin"},
 "train": {"steps": 12, "eval_every": 4, "eval_steps": 2, "sample_tokens": 20, "sample_prompt": "line"},
 "log": {"every": 4}}
JSON
"$LOOM" train --config "$WORK/cfg.json" --out "$WORK/run" > "$WORK/out.txt"
cat "$WORK/out.txt"
json_check "$WORK/run/metrics.jsonl" 'len(lines) == 12 and [l["step"] for l in lines] == list(range(1, 13))'
json_check "$WORK/run/metrics.jsonl" 'all(k in l for l in lines for k in ("loss","lr","grad_norm","loss_scale","tokens_per_s","mfu","mem","time"))'
json_check "$WORK/run/metrics.jsonl" 'all(set(l["time"]) >= {"forward","backward","recompute","optimizer","comm","comm_exposed","bubble"} for l in lines)'
json_check "$WORK/run/metrics.jsonl" 'all(l["time"]["recompute"] == 0 for l in lines)'
json_check "$WORK/run/metrics.jsonl" 'all(l["gemm_backend"] in ("openblas", "onednn") and l["gemm_path"] == "f32 sgemm" and l["peak_gflops"] > 0 and 0 < l["mfu"] <= 1 for l in lines)'
# bf16 GEMM inputs: the MFU denominator is the peak of the path the GEMMs
# take (oneDNN's bf16 matmul where it runs, measured and cached under its
# own key), not the sgemm's. kernels.gemm_inputs auto (the default) takes
# bf16 inputs where oneDNN's bf16 matmul pays (AMX tiles, an AMD CPU's
# AVX512-BF16), and says why either way.
"$LOOM" train --config "$WORK/cfg.json" --set bf16.enabled=true \
  --set train.steps=2 --set train.sample_tokens=0 --set train.eval_every=0 --out "$WORK/runauto" > "$WORK/outauto.txt"
if grep -q "GEMM inputs rounded to bf16, products accumulated in f32 (oneDNN's bf16 matmul); kernels.gemm_inputs auto: bf16: auto, oneDNN's bf16 matmul on \(AMX tiles (ISA avx512_core_amx)\|an AMD CPU's AVX512-BF16 (ISA [a-z0-9_]*)\)" "$WORK/outauto.txt"; then
  json_check "$WORK/runauto/metrics.jsonl" "all(l['gemm_path'] == 'bf16 matmul' for l in lines)"
else
  grep -q "GEMM inputs f32 in a bf16 run; kernels.gemm_inputs auto: f32: auto, \(ISA .* without AMX and not an AMD CPU\|ISA .* emulates the bf16 instructions\|ISA .* has no bf16 matmul\|this build has no oneDNN\)" "$WORK/outauto.txt" ||
    fail "kernels.gemm_inputs auto's choice not logged: $(cat "$WORK/outauto.txt")"
  json_check "$WORK/runauto/metrics.jsonl" "all(l['gemm_path'] == 'f32 sgemm' for l in lines)"
fi
if "$LOOM" train --config "$WORK/cfg.json" --set bf16.enabled=true --set kernels.gemm_inputs=16bit \
  --set train.steps=2 --set train.sample_tokens=0 --set train.eval_every=0 --out "$WORK/run16" > "$WORK/out16.txt" 2>&1; then
  grep -q "GEMM inputs rounded to bf16.*oneDNN's bf16 matmul" "$WORK/out16.txt" || fail "16bit: $(cat "$WORK/out16.txt")"
  path="bf16 matmul"
  json_check "$WORK/run16/metrics.jsonl" "all(l['gemm_path'] == '$path' and l['peak_gflops'] > 0 and 0 < l['mfu'] <= 1 for l in lines)"
  grep -q "the 2048^3 bf16 matmul, the path this run's GEMMs take" "$WORK/out16.txt" || fail "bf16 peak not logged: $(cat "$WORK/out16.txt")"
  python3 - "$XDG_CACHE_HOME/loom/peak_gflops.json" "$WORK/run16/metrics.jsonl" <<'PY' || fail "the bf16 run's peak is not the cached bf16 matmul peak"
import json, sys
cache = json.load(open(sys.argv[1]))
bf16 = [v["gflops"] for k, v in cache.items() if k.endswith("| bf16 matmul")]
peak = json.loads(open(sys.argv[2]).readline())["peak_gflops"]
assert len(bf16) == 1 and abs(peak - bf16[0]) <= 1e-3 * bf16[0], (bf16, peak)
PY
else
  # A CPU without a bf16 matmul: 16bit is refused, naming the ISA.
  grep -q "kernels.gemm_inputs: 16bit with bf16.enabled: this CPU has no bf16 GEMM (oneDNN's bf16 matmul does not run at ISA" "$WORK/out16.txt" ||
    fail "16bit without a bf16 matmul: $(cat "$WORK/out16.txt")"
fi
# Which GEMM backends this build has (oneDNN unless configured without).
"$LOOM" bench gemm --sizes 64 --reps 1 --json > "$WORK/gemm-probe.json"
onednn=$(python3 -c 'import json,sys; print(int("onednn" in json.load(open(sys.argv[1]))["backends"]))' "$WORK/gemm-probe.json")
if ((onednn)); then
  grep -q "loom: GEMM onednn (.*; auto: oneDNN whenever this build has it): [0-9]* GFLOP/s" "$WORK/out.txt" ||
    fail "GEMM choice not logged: $(cat "$WORK/out.txt")"
else
  grep -q "loom: GEMM openblas (.*; auto: this build has no oneDNN)" "$WORK/out.txt" ||
    fail "GEMM choice not logged: $(cat "$WORK/out.txt")"
fi
json_check "$WORK/run/metrics.jsonl" 'all(set(l["mem"]) == {"params","grads","optimizer","activations","comm","workspace"} for l in lines)'
json_check "$WORK/run/metrics.jsonl" '[l["step"] for l in lines if "val_loss" in l] == [4, 8, 12]'
json_check "$WORK/run/metrics.jsonl" 'lines[-1]["loss"] < lines[0]["loss"] - 0.5'
# WarmupDecayLR: log warm-up over 3 steps from 0, then linear decay to 0 at 12.
json_check "$WORK/run/metrics.jsonl" 'lines[0]["lr"] == 0 and abs(lines[3]["lr"] - 3e-3 * 9 / 9) < 1e-12 and abs(lines[6]["lr"] - 3e-3 * 6 / 9) < 1e-12'
json_check "$WORK/run/config.resolved.json" 'd["train_micro_batch_size_per_gpu"] == 4 and d["model"]["n_embd"] == 32 and d["scheduler"]["type"] == "WarmupDecayLR"'
grep -q "loom: threads: 2" "$WORK/out.txt" || fail "thread count not logged"
grep -q -- "--- sample" "$WORK/out.txt" || fail "no sample printed"
grep -q "loom: done in" "$WORK/out.txt" || fail "no summary"

# Full recomputation from the CLI: the same losses as without, less activation
# memory, recompute time reported, the plan logged.
"$LOOM" train --config "$WORK/cfg.json" --set activation_checkpointing.policy=full \
  --set activation_checkpointing.profile=true --out "$WORK/run-full" > "$WORK/out-full.txt"
grep -q "loom: activation checkpointing full: 2 blocks: 0 whole, 0 selective, 2 full; LM-head logits recomputed" \
  "$WORK/out-full.txt" || fail "no recompute plan logged: $(cat "$WORK/out-full.txt")"
grep -q "activation_checkpointing.profile: recompute time is always in metrics.jsonl" "$WORK/out-full.txt" ||
  fail "DeepSpeed key not logged"
python3 - "$WORK/run/metrics.jsonl" "$WORK/run-full/metrics.jsonl" <<'PY' || fail "full recomputation differs"
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert [l["loss"] for l in a] == [l["loss"] for l in b], "losses differ"
assert [l.get("val_loss") for l in a] == [l.get("val_loss") for l in b], "validation differs"
assert all(l["time"]["recompute"] > 0 for l in b)
assert max(l["mem"]["activations"] for l in b) < 0.6 * max(l["mem"]["activations"] for l in a)
print("ok: full recomputation trains the same losses with", max(l["mem"]["activations"] for l in b),
      "activation bytes instead of", max(l["mem"]["activations"] for l in a))
PY

# An affinity narrower than the thread count is reported.
taskset -c 0 "$LOOM" train --config "$WORK/cfg.json" --set train.steps=1 --set train.eval_every=0 \
  --set train.sample_tokens=0 --out "$WORK/run1" > "$WORK/out1.txt"
grep -q "loom: warning: this rank may run on 1 core(s) but uses 2 threads" "$WORK/out1.txt" ||
  fail "no affinity warning: $(cat "$WORK/out1.txt")"

"$LOOM" bench gemm --sizes 256,512 --reps 3 --json > "$WORK/gemm.json"
json_check "$WORK/gemm.json" 'd["peak_gflops"] > 0 and [s["n"] for s in d["sizes"]] == [256, 512] and "openblas" in d["backends"] and d["gemm_backend"] in d["backends"] and d["peak_gflops"] == max(b["peak_gflops"] for b in d["backends"].values())'
# bf16 matmul: oneDNN runs it from AVX-512 on.
if ((onednn)) && grep -qw avx512f /proc/cpuinfo; then
  "$LOOM" bench gemm --sizes 128 --reps 2 --dtype f32,bf16 --model "$WORK/cfg.json" --json > "$WORK/gemm-bf16.json"
  json_check "$WORK/gemm-bf16.json" '[m["shape"] for m in d["matmul"]] == ["128^3", "c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "lm head"] and all(m["f32_gflops"] > 0 and m["bf16_gflops"] > 0 for m in d["matmul"]) and d["mfu_peak_gflops"] > 0 and d["mfu_peak_bf16_matmul"]["gflops"] >= d["mfu_peak_bf16_matmul"]["measured_gflops"] > 0'
fi
# OpenBLAS forced onto its generic kernel on a CPU with AVX2: warned, with the fix.
if grep -qw avx2 /proc/cpuinfo; then
  OPENBLAS_CORETYPE=Prescott "$LOOM" bench gemm --sizes 128 --reps 1 --backend openblas --json > "$WORK/gemm-generic.json"
  json_check "$WORK/gemm-generic.json" '"generic" in d.get("warning", "") and "OPENBLAS_CORETYPE" in d["warning"] and d["backends"]["openblas"]["isa"] == "Prescott"'
fi
"$LOOM" bench train --config "$WORK/cfg.json" --set data.synthetic=true --steps 3 --warmup 1 --json > "$WORK/bench.json"
json_check "$WORK/bench.json" 'd["tokens_per_s"] > 0 and 0 < d["mfu"] <= 1 and d["gemm_path"] == "f32 sgemm" and d["gemm_backend"] in ("onednn", "openblas") and d["model_flops_per_s"] > 0 and d["peak_bytes"]["params"] > 0 and d["peak_bytes"]["optimizer"] == 2 * d["peak_bytes"]["params"]'
# The GEMM-bound ceiling: the step's GEMMs counted by form and replayed alone; the forms add up to
# the GEMM time, and they multiply about the model's FLOPs (within 20%: the attention core skips
# the blocks its causal mask empties and recomputes its scores in backward).
"$LOOM" bench train --config "$WORK/cfg.json" --set data.synthetic=true --steps 3 --warmup 1 --ceiling --ceiling-rounds 3 --json > "$WORK/bench-ceiling.json"
json_check "$WORK/bench-ceiling.json" '(lambda c: len(c["forms"]) > 0 and all(f["calls"] > 0 and f["seconds_per_call"] > 0 for f in c["forms"]) and abs(sum(f["seconds"] for f in c["forms"]) - c["gemm_time_s"]) <= 1e-9 * (1 + c["gemm_time_s"]) and c["rounds"] == 3 == len(c["fractions"]) and c["fraction"] == sorted(c["fractions"])[1] and all(x > 0 for x in c["fractions"]) and c["step_time_s"] > 0 and abs(c["tokens_per_s"] * c["gemm_time_s"] - d["tokens_per_step"]) < 1e-6 * d["tokens_per_step"] and 0.8 < c["gemm_flops_per_token"] / c["model_flops_per_token"] < 1.2 and abs(c["model_flops_per_token"] - d["model_flops_per_s"] / d["tokens_per_s"]) < 1e-6 * c["model_flops_per_token"])(d["gemm_ceiling"])'
echo PASS
