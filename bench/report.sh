#!/usr/bin/env bash
# loom report on a long run: 100,000 steps of metrics (one real step's
# record repeated with a noisy, decaying loss and a few spikes), the page's
# size, the time loom report takes and the time the page takes to open and
# draw in headless Chromium (median of 5). Needs LOOM_SETUP_BROWSER=1
# scripts/setup.sh and a built loom (LOOM=build/apps/loom/loom).
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-build/apps/loom/loom}
STEPS=${STEPS:-100000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
mkdir -p "$work/text"
for i in $(seq 1 200); do echo "line $i: the quick brown fox jumps over the lazy dog."; done > "$work/text/a.txt"
"$LOOM" prepare-data --input "$work/text" --tokenizer byte --val-fraction 0.2 --out "$work/data" >/dev/null
cat > "$work/cfg.json" <<JSON
{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
 "model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "seq_len": 32},
 "data": {"train": "$work/data/train.bin"}, "train": {"steps": 2}}
JSON
"$LOOM" train --config "$work/cfg.json" --out "$work/seed" >/dev/null
python3 - "$work/seed" "$work/long" "$STEPS" <<'PY'
import json, math, os, random, shutil, sys
seed, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(out)
shutil.copy(os.path.join(seed, "config.resolved.json"), out)
rec = json.loads(open(os.path.join(seed, "metrics.jsonl")).readline())
random.seed(1)
with open(os.path.join(out, "metrics.jsonl"), "w") as f:
    for s in range(1, n + 1):
        rec["step"] = s
        rec["loss"] = 2 + 3 * math.exp(-s / (n / 10)) + random.gauss(0, 0.02) + (4 if s % 33331 == 0 else 0)
        rec["grad_norm"] = 1 + random.random()
        if s % 1000 == 0: rec["val_loss"] = rec["loss"]
        else: rec.pop("val_loss", None)
        f.write(json.dumps(rec) + "\n")
PY
t0=$(date +%s.%N)
"$LOOM" report "$work/long" --out "$work/long.html" >/dev/null
t1=$(date +%s.%N)
cat > "$work/open.mjs" <<'JS'
import { createRequire } from "module";
import url from "url";
const require = createRequire(process.env.NPM_DIR + "/node_modules/");
const { chromium } = require("playwright-core");
const browser = await chromium.launch({ executablePath: "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"] });
const times = [];
for (let i = 0; i < 5; i++) {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  const t = Date.now();
  await page.goto(url.pathToFileURL(process.argv[2]).href, { waitUntil: "load" });
  await page.waitForFunction(() => window.loomReport && window.loomReport.done);
  times.push(Date.now() - t);
  await page.close();
}
await browser.close();
times.sort((a, b) => a - b);
console.log(times[2]);
JS
open_ms=$(NPM_DIR="$PWD/.cache/npm" node "$work/open.mjs" "$work/long.html")
bytes=$(stat -c %s "$work/long.html")
python3 -c "import sys; print(f'report of {sys.argv[1]} steps: page {int(sys.argv[2])/1e6:.2f} MB, loom report {float(sys.argv[4])-float(sys.argv[3]):.2f} s, page opened and drawn in {sys.argv[5]} ms (median of 5, headless Chromium)')" \
  "$STEPS" "$bytes" "$t0" "$t1" "$open_ms"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
