# Shared by the tests that run across the hosts of the test cluster
# (scripts/cluster.sh). Source it after `set -euo pipefail`; it defines
# CLUSTER, WORK (removed at exit, with the cluster), fail, until_within,
# in_hosts, and cluster_up N [--bandwidth RATE], which exits 77 (skipped)
# where network namespaces cannot be made.
CLUSTER=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/cluster.sh
export OMP_NUM_THREADS=1
WORK=$(mktemp -d)
export XDG_CACHE_HOME="$WORK/cache"
JOBS=()
cluster_cleanup() {
  for j in ${JOBS[@]+"${JOBS[@]}"}; do kill -9 "$j" 2> /dev/null || true; done
  "$CLUSTER" down 2> /dev/null || true
  rm -rf "$WORK"
}
trap cluster_cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
cluster_up() {
  if ! "$CLUSTER" up "$@" > "$WORK/up.txt" 2>&1; then
    echo "SKIP: no test cluster here (network namespaces, veth, bridge, tc): $(cat "$WORK/up.txt")"
    exit 77
  fi
  CLUSTER_HOSTS=$1
}
# until_within SECONDS CMD...: polls CMD until it succeeds; fails after SECONDS.
until_within() {
  local limit=$1 t0=$SECONDS
  shift
  until "$@"; do
    ((SECONDS - t0 <= limit)) || return 1
    sleep 0.2
  done
}
# Processes still running inside the cluster's hosts (ranks, daemons).
in_hosts() {
  for ((i = 0; i < CLUSTER_HOSTS; ++i)); do ip netns pids "loom-h$i"; done | wc -l
}
# The losses of a run folder, one per line ("step loss"), for comparison.
losses() {
  python3 -c 'import json,sys
for l in open(sys.argv[1]):
    j = json.loads(l); print(j["step"], repr(j["loss"]))' "$1/metrics.jsonl"
}
