#!/usr/bin/env bash
# Bad input: one-line errors that name the key or file, non-zero exit, and
# nothing written into an existing run folder.
source "$(dirname "$0")/lib.sh"

good='{"train_micro_batch_size_per_gpu": 2,
  "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256, "seq_len": 16},
  "data": {"synthetic": true}, "train": {"steps": 2}, "log": {"peak_gflops": 100}}'
echo "$good" > "$WORK/good.json"

# An existing run folder with a file in it must stay untouched by failures.
mkdir -p "$WORK/run" && echo keep > "$WORK/run/marker"
run() { "$LOOM" train --out "$WORK/run" --overwrite "$@"; }

printf '{\n  "model": {\n    "n_layer": 2,,\n  }\n}\n' > "$WORK/bad.json"
expect_error "bad.json: invalid JSON at line 3, column 18" run --config "$WORK/bad.json"
expect_error "unknown key 'model.n_embed' (did you mean 'model.n_embd'?)" \
  run --config "$WORK/good.json" --set model.n_embed=64
expect_error "model.n_layer: expected an integer, got a string" \
  run --config "$WORK/good.json" --set model.n_layer='"two"'
expect_error "train_micro_batch_size_per_gpu: 0 is out of range" \
  run --config "$WORK/good.json" --set train_micro_batch_size_per_gpu=0
expect_error "model.seq_len: -4 is out of range" run --config "$WORK/good.json" --set model.seq_len=-4
expect_error "model.n_embd 30 is not divisible by model.n_head 4" \
  run --config "$WORK/good.json" --set model.n_embd=30 --set model.n_head=4
expect_error "train_batch_size 3 != train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 1 x data-parallel size 1 (= 2)" \
  run --config "$WORK/good.json" --set train_batch_size=3 --set gradient_accumulation_steps=1
expect_error "$WORK/missing.json: cannot open config file" run --config "$WORK/missing.json"
expect_error "activation_checkpointing.policy: unknown value \"most\" (expected one of none, full, selective, every_n, budget)" \
  run --config "$WORK/good.json" --set activation_checkpointing.policy=most
expect_error "activation_checkpointing.policy is budget but activation_checkpointing.budget_bytes is not set" \
  run --config "$WORK/good.json" --set activation_checkpointing.policy=budget
expect_error "activation_checkpointing.budget_bytes 1000 is too small: one block's input is 4096 bytes per micro-batch, and this stage needs at least" \
  run --config "$WORK/good.json" --set activation_checkpointing.policy=budget --set activation_checkpointing.budget_bytes=1000
expect_error "activation_checkpointing.budget_bytes 10000 is too small: one block's input is 4096 bytes" \
  run --config "$WORK/good.json" --set activation_checkpointing.policy=budget --set activation_checkpointing.budget_bytes=10000
expect_error "the job's 1 rank(s) do not divide into parallel.tensor 1 x parallel.pipeline 2" \
  run --config "$WORK/good.json" --set parallel.pipeline=2
expect_error "parallel.expert is 2 but the model has no mixture-of-experts layers" \
  run --config "$WORK/good.json" --set parallel.expert=2
expect_error "parallel.virtual_stages 2 needs parallel.schedule interleaved (it is 1f1b)" \
  run --config "$WORK/good.json" --set parallel.virtual_stages=2

# seq_len beyond the data: a token file with 10 tokens.
mkdir -p "$WORK/text" && printf 'tiny text' > "$WORK/text/a.txt"
"$LOOM" prepare-data --input "$WORK/text" --tokenizer byte --val-fraction 0 --out "$WORK/tiny" >/dev/null
expect_error "data.train $WORK/tiny/train.bin: 9 tokens, fewer than one window of model.seq_len + 1 = 17" \
  run --config "$WORK/good.json" --set data.synthetic=false --set data.train="$WORK/tiny/train.bin"
printf 'XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX' > "$WORK/junk.bin"
expect_error "$WORK/junk.bin: not a token file (wrong magic)" \
  run --config "$WORK/good.json" --set data.synthetic=false --set data.train="$WORK/junk.bin"

[[ $(ls "$WORK/run") == marker && $(cat "$WORK/run/marker") == keep ]] || fail "run folder was modified"
echo "ok: run folder untouched"

# A non-empty run folder is refused without --overwrite, before any work.
expect_error "run folder $WORK/run already exists and is not empty" \
  "$LOOM" train --config "$WORK/good.json" --out "$WORK/run"

# prepare-data: empty and non-UTF-8 inputs name the file and offset; nothing is written.
: > "$WORK/empty.txt"
expect_error "$WORK/empty.txt: file is empty" \
  "$LOOM" prepare-data --input "$WORK/empty.txt" --out "$WORK/p1"
printf 'abc\xff\xfedef' > "$WORK/latin.txt"
expect_error "$WORK/latin.txt: not valid UTF-8 at byte offset 3" \
  "$LOOM" prepare-data --input "$WORK/latin.txt" --out "$WORK/p1"
expect_error "$WORK/nowhere.txt: no such file or folder" \
  "$LOOM" prepare-data --input "$WORK/text" --input "$WORK/nowhere.txt" --out "$WORK/p1"
[[ ! -e "$WORK/p1" ]] || fail "prepare-data wrote output after an error"
expect_error "$WORK/tiny/train.bin: already exists" \
  "$LOOM" prepare-data --input "$WORK/text" --out "$WORK/tiny"
echo PASS
