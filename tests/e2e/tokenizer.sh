#!/usr/bin/env bash
# Tokenizers from the command line: tokenize and --decode, gpt2 token files
# from prepare-data, and training on them.
source "$(dirname "$0")/lib.sh"

[[ $(printf 'Hello, world!' | "$LOOM" tokenize --tokenizer gpt2) == "15496 11 995 0" ]] || fail "gpt2 encode"
[[ $(printf 'Hi' | "$LOOM" tokenize --tokenizer byte) == "72 105" ]] || fail "byte encode"
printf 'Zürich 😀  two spaces\n\ttab\n' > "$WORK/u.txt"
"$LOOM" tokenize --tokenizer gpt2 < "$WORK/u.txt" > "$WORK/ids.txt"
"$LOOM" tokenize --tokenizer gpt2 --decode < "$WORK/ids.txt" > "$WORK/back.txt"
cmp "$WORK/u.txt" "$WORK/back.txt" || fail "gpt2 round trip"
echo "ok: round trip"
expect_error "token id 50257 is beyond the gpt2 vocabulary (50257)" \
  bash -c "echo 1 50257 | '$LOOM' tokenize --tokenizer gpt2 --decode"
expect_error "'x7' is not a token id" bash -c "echo 1 x7 | '$LOOM' tokenize --tokenizer byte --decode"
expect_error "unknown tokenizer 'bpe' (expected byte or gpt2)" \
  bash -c "echo hi | '$LOOM' tokenize --tokenizer bpe"

# gpt2 token files: as many tokens as tokenize prints, and a model trains on them.
mkdir -p "$WORK/text"
for i in $(seq 1 100); do echo "Entry $i: it's a truth universally acknowledged, isn't it?"; done > "$WORK/text/a.txt"
"$LOOM" prepare-data --input "$WORK/text" --tokenizer gpt2 --val-fraction 0 --out "$WORK/data" >/dev/null
n=$("$LOOM" tokenize --tokenizer gpt2 < "$WORK/text/a.txt" | wc -w)
json_check "$WORK/data/meta.json" "d['tokenizer'] == 'gpt2' and d['vocab_size'] == 50257 and d['train_tokens'] == $n"
cat > "$WORK/cfg.json" <<JSON
{"train_batch_size": 2, "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 50257, "seq_len": 16},
 "data": {"train": "$WORK/data/train.bin", "sampling": "sequential"}, "train": {"steps": 3},
 "checkpoint": {"every": 3}, "log": {"peak_gflops": 100}}
JSON
"$LOOM" train --config "$WORK/cfg.json" --out "$WORK/run" >/dev/null
json_check "$WORK/run/metrics.jsonl" 'len(lines) == 3 and abs(lines[0]["loss"] - 10.825) < 0.3'
"$LOOM" generate --checkpoint "$WORK/run/checkpoints/step-00000003" --prompt "Entry" --max-tokens 5 >/dev/null
echo "ok: gpt2 data, training and generation"
expect_error "data.train $WORK/data/train.bin: the file's vocabulary (50257) is larger than model.vocab_size (256)" \
  "$LOOM" train --config "$WORK/cfg.json" --set model.vocab_size=256 --out "$WORK/run2"
echo PASS
