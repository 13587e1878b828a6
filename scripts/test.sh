#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (unit, e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM_SETUP_BROWSER=1 scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build
ctest --test-dir build --output-on-failure "$@"
