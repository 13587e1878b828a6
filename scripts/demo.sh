#!/usr/bin/env bash
# Sets up, builds, prepares the demo data (the text of Debian's fortunes
# package, byte-level) and trains configs/demo.json, then prints a sample.
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
