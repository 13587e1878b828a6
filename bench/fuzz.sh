#!/usr/bin/env bash
# Fuzzes loom's parsers with libFuzzer (clang, with ASan + UBSan): each
# target in turn for SECONDS (default 300), starting from its inputs in
# tests/fixtures/fuzz/<target>/ and a corpus kept in build-fuzz/corpus/.
# Prints executions, corpus size and findings per target; a crasher is
# copied into tests/fixtures/fuzz/<target>/ so the normal test run replays
# it (unit.fuzz_replay.*) once it is fixed.
#
#   bench/fuzz.sh                       SECONDS_EACH=300 TARGETS="config safetensors ..."
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${SECONDS_PER_TARGET:-${SECONDS_EACH:-300}}
targets=${TARGETS:-"config safetensors token_file checkpoint_meta gpt2 gpt2_files"}
command -v clang++ > /dev/null || { echo "bench/fuzz.sh needs clang (apt-get install clang)" >&2; exit 1; }
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DLOOM_FUZZ=ON -DLOOM_NATIVE=OFF > /dev/null
cmake --build build-fuzz $(for t in $targets; do echo --target loom_fuzz_$t; done) > /dev/null
export ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
echo "# $(lscpu | sed -n 's/^Model name: *//p' | head -1), clang $(clang++ -dumpversion), ${secs} s per target"
printf "%-16s %12s %10s %8s  %s\n" target executions exec/s corpus findings
for t in $targets; do
  corpus=build-fuzz/corpus/$t art=build-fuzz/artifacts/$t/
  mkdir -p "$corpus" "$art"
  log=build-fuzz/fuzz-$t.log
  build-fuzz/tests/loom_fuzz_$t "$corpus" "tests/fixtures/fuzz/$t" -max_total_time="$secs" \
    -print_final_stats=1 -artifact_prefix="$art" -close_fd_mask=3 > "$log" 2>&1 || true
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  found=""
  for c in "$art"crash-* "$art"oom-* "$art"timeout-*; do
    [[ -e $c ]] || continue
    cp "$c" "tests/fixtures/fuzz/$t/"
    found+="$(basename "$c") "
  done
  printf "%-16s %12s %10s %8s  %s\n" "$t" "${execs:-?}" "${rate:-?}" "$(ls "$corpus" | wc -l)" "${found:-none}"
done
