# Helpers for the end-to-end tests: each test runs the loom binary as a user
# does and checks exit codes, messages and files.
set -euo pipefail
LOOM=${LOOM:?set LOOM to the loom binary}
WORK=$(mktemp -d)
# The peak-GFLOP/s cache of these runs stays in the test folder.
export XDG_CACHE_HOME="$WORK/cache"
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

fail() { echo "FAIL: $*" >&2; exit 1; }

# expect_error "needle" cmd...: the command must exit non-zero, print exactly
# one line on stderr, and that line must contain needle.
expect_error() {
  local needle=$1; shift
  local out rc=0
  out=$("$@" 2>&1 >/dev/null) || rc=$?
  [[ $rc -ne 0 ]] || fail "expected failure: $*"
  [[ $(printf '%s\n' "$out" | wc -l) -eq 1 ]] || fail "expected one line on stderr, got: $out"
  [[ $out == *"$needle"* ]] || fail "expected '$needle' in: $out"
  echo "ok: $needle"
}

# json_check FILE PYTHON-EXPR: evaluates the expression with `d` bound to the
# parsed JSON (or `lines`, a list, for .jsonl files); fails when it is false.
json_check() {
  python3 - "$1" "$2" <<'PY' || fail "json check failed: $2 on $1"
import json, sys
path, expr = sys.argv[1], sys.argv[2]
text = open(path).read()
if path.endswith(".jsonl"):
    lines = [json.loads(l) for l in text.splitlines() if l.strip()]
    d = None
else:
    d = json.loads(text)
    lines = None
ok = eval(expr)
if not ok:
    print("false:", expr, file=sys.stderr)
    sys.exit(1)
PY
}
