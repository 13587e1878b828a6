#!/usr/bin/env bash
# A test cluster of hosts on this machine: each host is a network namespace
# with its own TCP stack (and, through the launcher agent, its own
# hostname), joined by veth pairs to a bridge that lives in a namespace of
# its own, with addresses from one private /24 (10.233.7.0/24) that exist in
# these namespaces only: nothing routes out of them, and the machine's own
# network is untouched.
#
#   scripts/cluster.sh up N      hosts loom-h0 .. loom-h{N-1} at 10.233.7.1 .. N
#   scripts/cluster.sh down      removes them
#   scripts/cluster.sh agent H CMD...
#                                Open MPI's rsh agent: runs CMD on host H (an
#                                address of the cluster) in its namespace
#                                with hostname node<i>
#   scripts/cluster.sh cut I / heal I
#                                takes host I's link down / up (a partition)
#   scripts/cluster.sh mpirun ARGS...
#                                mpirun from host 0 with the cluster's
#                                transport settings (TCP between hosts over
#                                the cluster's /24, the agent above)
# Needs root and iproute2.
set -euo pipefail
NET=10.233.7
BR=loom-br
host() { echo "loom-h$1"; }
self=$(readlink -f "$0")

up() {
  local n=$1
  down 2> /dev/null || true
  ip netns add "$BR"
  ip -n "$BR" link add br0 type bridge
  ip -n "$BR" link set br0 up
  ip -n "$BR" link set lo up
  for ((i = 0; i < n; ++i)); do
    local h
    h=$(host "$i")
    ip netns add "$h"
    ip link add "h$i" netns "$h" type veth peer name "p$i" netns "$BR"
    ip -n "$BR" link set "p$i" master br0 up
    ip -n "$h" link set lo up
    ip -n "$h" addr add "$NET.$((i + 1))/24" dev "h$i"
    ip -n "$h" link set "h$i" up
  done
}

down() {
  for h in $(ip netns list | awk '{print $1}' | grep -E '^loom-h[0-9]+$|^loom-br$'); do
    ip netns pids "$h" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
    ip netns del "$h"
  done
}

agent() {
  # Open MPI calls: AGENT [options] HOST CMD...; options before the host
  # (ssh-style) are ignored.
  while [[ $1 == -* ]]; do shift; done
  local addr=$1
  shift
  local i=$((${addr##*.} - 1))
  exec ip netns exec "$(host "$i")" unshare --uts sh -c 'hostname "$0"; exec "$@"' "node$i" \
    sh -c "$*"
}

case ${1:-} in
  up) up "${2:?number of hosts}" ;;
  down) down ;;
  agent)
    shift
    agent "$@"
    ;;
  cut) ip -n "$(host "$2")" link set "h$2" down ;;
  heal) ip -n "$(host "$2")" link set "h$2" up ;;
  mpirun)
    shift
    exec ip netns exec "$(host 0)" unshare --uts sh -c 'hostname node0; exec "$@"' sh \
      mpirun --allow-run-as-root --mca plm_rsh_agent "$self agent" \
      --mca btl self,vader,tcp --mca btl_tcp_if_include "$NET.0/24" \
      --mca oob_tcp_if_include "$NET.0/24" "$@"
    ;;
  *)
    sed -n '2,22p' "$self"
    exit 2
    ;;
esac
