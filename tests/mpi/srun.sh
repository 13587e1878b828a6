#!/usr/bin/env bash
# Under Slurm, MPI (not the environment) decides the world: `srun --mpi=pmix
# -n 2 loom train` is one job of 2 ranks (a world of 2, data-parallel 2),
# not two one-process jobs writing into the same run folder. Needs a
# running Slurm (sinfo answers) with the pmix plugin; exits 77 (skipped)
# where there is none.
set -euo pipefail
LOOM=${LOOM:?}
export OMP_NUM_THREADS=1
WORK=$(mktemp -d)
export XDG_CACHE_HOME="$WORK/cache"
trap 'rm -rf "$WORK"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
if ! command -v srun > /dev/null || ! timeout 10 sinfo > /dev/null 2>&1 ||
  ! srun --mpi=list 2>&1 | grep -q pmix; then
  echo "SKIP: no Slurm cluster with the pmix plugin here"
  exit 77
fi
cat > "$WORK/train.json" <<JSON
{"train_batch_size": 8, "model": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "seq_len": 32},
 "data": {"synthetic": true}, "train": {"steps": 3}, "log": {"peak_gflops": 100}}
JSON
# On this host (the run folder is local), within a minute of asking.
timeout 120 srun --mpi=pmix -n 2 -w "$(hostname)" --immediate=60 "$LOOM" train --config "$WORK/train.json" --out "$WORK/run" \
  > "$WORK/out.txt" 2>&1 || fail "srun: $(cat "$WORK/out.txt")"
grep -q "grid world 2" "$WORK/out.txt" || fail "not one job of 2 ranks: $(cat "$WORK/out.txt")"
[[ $(grep -c "grid world" "$WORK/out.txt") == 1 ]] || fail "more than one job reported: $(cat "$WORK/out.txt")"
python3 - "$WORK/run/config.resolved.json" <<'PY' || fail "the run is not data-parallel 2"
import json, sys
c = json.load(open(sys.argv[1]))
assert c["parallel"]["data"] == 2, c["parallel"]
PY
echo "ok: srun --mpi=pmix -n 2 is one job of 2 ranks"
echo PASS
