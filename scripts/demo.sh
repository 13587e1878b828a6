#!/usr/bin/env bash
# Sets up, builds, prepares the demo data (the text of Debian's fortunes
# package, byte-level), trains configs/demo.json into runs/demo (with
# checkpoints), then samples text from the last checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build
loom=build/apps/loom/loom
if [[ ! -f data/fortunes/meta.json ]]; then
  # The plain fortune files; the .dat indexes and .u8 links are not text.
  mapfile -t files < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' | sort)
  "$loom" prepare-data --tokenizer byte --val-fraction 0.05 --out data/fortunes \
    $(printf -- '--input %s ' "${files[@]}")
fi
"$loom" train --config configs/demo.json --out runs/demo --overwrite "$@"
checkpoint=runs/demo/checkpoints/$(cat runs/demo/checkpoints/latest)
echo
echo "--- sample from $checkpoint (loom generate, temperature 0.8) ---"
"$loom" generate --checkpoint "$checkpoint" --prompt "The " --max-tokens 300 \
  --temperature 0.8 --top-k 40 --seed 1
echo "---"
