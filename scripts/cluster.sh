#!/usr/bin/env bash
# A test cluster of hosts on this machine: each host is a network namespace
# with its own TCP stack (and, through the launcher agent, its own hostname
# node<i>), joined by veth pairs to a bridge that lives in a namespace of
# its own, with addresses from one private /24 (10.233.7.0/24) that exist in
# these namespaces only: no default route, no link out of them, and the
# machine's own network is untouched. Inside the hosts, node<i> resolves to
# host i (/etc/netns/loom-h<i>/hosts, which `ip netns exec` shows as
# /etc/hosts there).
#
#   scripts/cluster.sh up N [--bandwidth RATE]
#                                hosts node0 .. node{N-1} (namespaces loom-h<i>,
#                                addresses 10.233.7.1 .. N); RATE ("1gbit",
#                                "100mbit") limits each host's link both ways
#   scripts/cluster.sh down      removes them (and kills what runs inside)
#   scripts/cluster.sh exec I CMD...
#                                runs CMD on host I
#   scripts/cluster.sh throttle I RATE|none
#                                changes host I's link bandwidth, live
#   scripts/cluster.sh cut I / heal I
#                                takes host I's link down / up (a partition)
#   scripts/cluster.sh kill I    kills every process on host I (a lost host)
#   scripts/cluster.sh agent H CMD...
#                                Open MPI's rsh agent: runs CMD on host H
#                                (node<i> or its address)
#   scripts/cluster.sh mpirun ARGS...
#                                mpirun on host 0 with the cluster's settings
#                                (`cluster.sh mpirun-args` prints them): TCP
#                                between hosts over the /24 only, shared
#                                memory inside a host, the agent above, and
#                                an out-of-band keepalive that notices a lost
#                                host in about 16 s (LOOM_CLUSTER_KEEPALIVE
#                                below)
# Needs root and iproute2 (tc for --bandwidth).
set -euo pipefail
NET=10.233.7
BR=loom-br
host() { echo "loom-h$1"; }
self=$(readlink -f "$0")

# tbf with a burst of about 10 ms at the rate (at least 64 KiB), so a fast
# link is not held to packet-by-packet pacing.
shape() {
  local ns=$1 dev=$2 rate=$3
  if [[ $rate == none ]]; then
    tc -n "$ns" qdisc del dev "$dev" root 2> /dev/null || true
    return
  fi
  local bits
  bits=$(numfmt --from=si "$(tr kmg KMG <<< "${rate%bit}")")
  local burst=$((bits / 8 / 100))
  ((burst >= 65536)) || burst=65536
  tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms
}

throttle() {
  shape "$(host "$1")" "h$1" "$2"
  shape "$BR" "p$1" "$2"
}

up() {
  local n=$1 rate=none
  shift
  if [[ ${1:-} == --bandwidth ]]; then rate=${2:?--bandwidth RATE}; fi
  ((n >= 1 && n <= 200)) || { echo "cluster.sh up: 1 to 200 hosts, not $n" >&2; exit 2; }
  down 2> /dev/null || true
  ip netns add "$BR"
  ip -n "$BR" link add br0 type bridge
  ip -n "$BR" link set br0 up
  ip -n "$BR" link set lo up
  local hosts="127.0.0.1 localhost"$'\n'
  for ((i = 0; i < n; ++i)); do hosts+="$NET.$((i + 1)) node$i"$'\n'; done
  for ((i = 0; i < n; ++i)); do
    local h
    h=$(host "$i")
    mkdir -p "/etc/netns/$h"
    printf '%s' "$hosts" > "/etc/netns/$h/hosts"
    ip netns add "$h"
    ip link add "h$i" netns "$h" type veth peer name "p$i" netns "$BR"
    ip -n "$BR" link set "p$i" master br0 up
    ip -n "$h" link set lo up
    ip -n "$h" addr add "$NET.$((i + 1))/24" dev "h$i"
    ip -n "$h" link set "h$i" up
    [[ $rate == none ]] || throttle "$i" "$rate"
  done
}

down() {
  for h in $(ip netns list | awk '{print $1}' | grep -E '^loom-h[0-9]+$|^loom-br$'); do
    ip netns pids "$h" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
    ip netns del "$h"
    rm -rf "/etc/netns/$h"
  done
}

# Host index of "node3", "10.233.7.4" or "3".
index_of() {
  case $1 in
    node*) echo "${1#node}" ;;
    "$NET".*) echo $((${1##*.} - 1)) ;;
    *) echo "$1" ;;
  esac
}

on_host() {
  local i
  i=$(index_of "$1")
  shift
  [[ -e /run/netns/$(host "$i") ]] || { echo "cluster.sh: no host $i in the test cluster" >&2; exit 1; }
  exec ip netns exec "$(host "$i")" unshare --uts sh -c 'hostname "$0"; exec "$@"' "node$i" "$@"
}

mpirun_args=(--allow-run-as-root --mca plm_rsh_agent "$self agent"
  --mca btl self,vader,tcp --mca btl_tcp_if_include "$NET.0/24"
  --mca oob_tcp_if_include "$NET.0/24")
# The keepalive must notice a lost host before comm.timeout_s ends the
# ranks (docs/comm.md): LOOM_CLUSTER_KEEPALIVE="TIME INTERVAL PROBES"
# (seconds), or "off".
read -r ka_time ka_intvl ka_probes <<< "${LOOM_CLUSTER_KEEPALIVE:-10 2 3}"
if [[ $ka_time != off ]]; then
  mpirun_args+=(--mca oob_tcp_keepalive_time "$ka_time" --mca oob_tcp_keepalive_intvl "$ka_intvl"
    --mca oob_tcp_keepalive_probes "$ka_probes")
fi

case ${1:-} in
  up)
    shift
    up "${1:?number of hosts}" "${@:2}"
    ;;
  down) down ;;
  exec)
    shift
    on_host "$@"
    ;;
  throttle) throttle "$(index_of "${2:?host}")" "${3:?rate or none}" ;;
  cut) ip -n "$(host "$(index_of "$2")")" link set "h$(index_of "$2")" down ;;
  heal) ip -n "$(host "$(index_of "$2")")" link set "h$(index_of "$2")" up ;;
  kill) ip netns pids "$(host "$(index_of "$2")")" | xargs -r kill -9 2> /dev/null || true ;;
  agent)
    # Open MPI calls: AGENT [options] HOST CMD...; options before the host
    # (ssh-style) are ignored.
    shift
    while [[ $1 == -* ]]; do shift; done
    h=$1
    shift
    # Not exec'd: like ssh, the agent stays, with its host among its
    # arguments, until the daemon ends (loom launch watches for that).
    (on_host "$h" sh -c "$*")
    ;;
  mpirun-args) printf '%q ' "${mpirun_args[@]}" && echo ;;
  mpirun)
    shift
    on_host 0 mpirun "${mpirun_args[@]}" "$@"
    ;;
  *)
    sed -n '2,34p' "$self"
    exit 2
    ;;
esac
