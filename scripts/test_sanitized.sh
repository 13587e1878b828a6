#!/usr/bin/env bash
# The unit tests, the fuzz inputs and the 2-rank layout-equivalence harness under
# AddressSanitizer + UndefinedBehaviorSanitizer (a Debug build in
# build-asan/). Any report fails the run. CI runs it after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake -S . -B build-asan -G Ninja -DLOOM_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
fuzz=(config safetensors token_file checkpoint_meta gpt2 gpt2_files)
cmake --build build-asan --target loom_unit_tests loom_layout_tests \
  $(for t in "${fuzz[@]}"; do echo "loom_fuzz_replay_$t"; done)
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "== unit tests (ASan + UBSan, leak checking on)"
OMP_NUM_THREADS=2 ASAN_OPTIONS=halt_on_error=1 build-asan/tests/loom_unit_tests --gtest_brief=1
echo "== fuzz inputs replayed (tests/fixtures/fuzz: seeds and every finding)"
for t in "${fuzz[@]}"; do
  ASAN_OPTIONS=halt_on_error=1 build-asan/tests/loom_fuzz_replay_$t tests/fixtures/fuzz/$t
done
echo "== layout harness, 2 ranks (ASan + UBSan; Open MPI's own allocations are not leak-checked)"
OMP_NUM_THREADS=1 ASAN_OPTIONS=halt_on_error=1:detect_leaks=0 \
  mpirun --oversubscribe -np 2 build-asan/tests/loom_layout_tests --gtest_brief=1
echo "sanitized: PASS"
