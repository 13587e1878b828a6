#!/usr/bin/env bash
# The README's first command, as a new user runs it: set-up, build, demo data,
# training on the fortunes text, summary and a sample.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp)
trap 'rm -f "$out"' EXIT
scripts/demo.sh | tee "$out"
grep -q "loom: done in" "$out" || { echo "FAIL: no summary"; exit 1; }
grep -q -- "--- sample from runs/demo/checkpoints/step-00000500" "$out" || { echo "FAIL: no sample"; exit 1; }
python3 - <<'PY'
import json
lines = [json.loads(l) for l in open("runs/demo/metrics.jsonl")]
first, last = lines[0]["loss"], lines[-1]["loss"]
vals = [l["val_loss"] for l in lines if "val_loss" in l]
print(f"demo: loss {first:.3f} -> {last:.3f}, val {vals[-1]:.3f}")
assert abs(first - 5.545) < 0.2, "initial loss should be near ln(256)"
assert last < 2.5 and vals[-1] < 2.5, "the demo model did not learn"
PY
echo PASS
