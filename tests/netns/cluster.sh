#!/usr/bin/env bash
# Three fake hosts (h1, h2, h3) on this machine, as network namespaces joined by a bridge,
# and one command run by mpirun's side of them (inside h1, with hostname h1).
#
#   tests/netns/cluster.sh up                    create the namespaces
#   tests/netns/cluster.sh run -- CMD ARGS...    run CMD in h1 (mpirun goes here)
#   tests/netns/cluster.sh down                  delete everything (safe to repeat)
#   tests/netns/cluster.sh with -- CMD ARGS...   up, run, and down even if CMD fails
#
# OpenMPI reaches h2 and h3 through rsh-agent.sh (an `ip netns exec` instead of ssh).
# Environment for CMD: MPIFLOW_NETNS_MCA holds the mpirun options that keep OpenMPI on
# the namespaces' subnet. Needs root, iproute2 and util-linux.
#
# A shaped network: MPIFLOW_NETNS_RATE=10gbit (or 1gbit, 500mbit: tc's units) limits what
# each host sends and what it receives to that rate (a token bucket, `tc qdisc tbf`, on
# both ends of the host's link: a full-duplex switch port), so transfers between hosts
# take the time of a real link of that speed instead of a memory copy's, and two hosts
# sending to a third share its port as on a real switch. Unset: unshaped. No delay is added: this kernel has no `sch_netem` (and no `fq`
# for timestamp pacing); a link's latency here is the veth's (~5 us one way through MPI).
set -euo pipefail

PREFIX=${MPIFLOW_NETNS_PREFIX:-mpiflow}
SUBNET=${MPIFLOW_NETNS_SUBNET:-10.213.77}
HOSTS=(h1 h2 h3)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

ns() { echo "${PREFIX}-$1"; }

down() {
  for h in "${HOSTS[@]}" br; do
    if ip netns list | grep -qw "$(ns "$h")"; then
      # Kill anything left inside before deleting the namespace.
      for pid in $(ip netns pids "$(ns "$h")" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns delete "$(ns "$h")" 2>/dev/null || true
    fi
    rm -rf "/etc/netns/$(ns "$h")"
  done
  for i in 1 2 3; do ip link delete "${PREFIX:0:6}v$i" 2>/dev/null || true; done
}

# The token bucket's depth for RATE: 100 us of the rate, at least 64 KiB (tbf needs a
# bucket of several packets at high rates, as its timer is not exact).
burst() {
  local rate=$1 bits
  case $rate in
    *gbit) bits=$((${rate%gbit} * 1000000000)) ;;
    *mbit) bits=$((${rate%mbit} * 1000000)) ;;
    *kbit) bits=$((${rate%kbit} * 1000)) ;;
    *) echo "MPIFLOW_NETNS_RATE=$rate: give it as Ngbit, Nmbit or Nkbit" >&2; return 2 ;;
  esac
  local bytes=$((bits / 8 / 10000))
  echo $((bytes > 65536 ? bytes : 65536))
}

up() {
  if [[ -n ${MPIFLOW_NETNS_RATE:-} ]]; then burst "$MPIFLOW_NETNS_RATE" >/dev/null; fi
  down
  ip netns add "$(ns br)"
  ip -n "$(ns br)" link add br0 type bridge
  ip -n "$(ns br)" link set br0 up
  local i=0
  for h in "${HOSTS[@]}"; do
    i=$((i + 1))
    local v="${PREFIX:0:6}v$i" p="${PREFIX:0:6}p$i"
    ip netns add "$(ns "$h")"
    ip link add "$v" type veth peer name "$p"
    ip link set "$v" netns "$(ns br)"
    ip link set "$p" netns "$(ns "$h")"
    ip -n "$(ns br)" link set "$v" master br0 up
    ip -n "$(ns "$h")" link set lo up
    # The hosts' names resolve inside each of them (`ip netns exec` mounts this file
    # over /etc/hosts), as a cluster's do.
    mkdir -p "/etc/netns/$(ns "$h")"
    { echo "127.0.0.1 localhost"; for j in 1 2 3; do echo "$SUBNET.$j h$j"; done; } \
      >"/etc/netns/$(ns "$h")/hosts"
    ip -n "$(ns "$h")" addr add "$SUBNET.$i/24" dev "$p"
    ip -n "$(ns "$h")" link set "$p" up
    if [[ -n ${MPIFLOW_NETNS_RATE:-} ]]; then
      # The host's side shapes what it sends, the bridge's side what it receives.
      ip netns exec "$(ns "$h")" tc qdisc add dev "$p" root tbf rate "$MPIFLOW_NETNS_RATE" \
        burst "$(burst "$MPIFLOW_NETNS_RATE")" latency 10ms
      ip netns exec "$(ns br)" tc qdisc add dev "$v" root tbf rate "$MPIFLOW_NETNS_RATE" \
        burst "$(burst "$MPIFLOW_NETNS_RATE")" latency 10ms
    fi
  done
  if [[ -n ${MPIFLOW_NETNS_RATE:-} ]]; then
    echo "# netns cluster: each host sends and receives at most $MPIFLOW_NETNS_RATE (tc tbf)" >&2
  fi
  # Wait until h1 reaches the others.
  for i in 2 3; do
    for _ in $(seq 50); do
      ip netns exec "$(ns h1)" ping -c1 -W1 "$SUBNET.$i" >/dev/null 2>&1 && break
      sleep 0.1
    done
  done
}

run() {
  export MPIFLOW_NETNS_PREFIX=$PREFIX
  # UCX (when a job picks it) on TCP only: UCX takes hosts with one kernel boot id for one
  # machine and would carry their traffic through shared memory.
  export MPIFLOW_NETNS_MCA="--mca plm_rsh_agent $HERE/rsh-agent.sh --mca oob_tcp_if_include $SUBNET.0/24 --mca btl tcp,self --mca btl_tcp_if_include $SUBNET.0/24 -x UCX_TLS=self,tcp"
  ip netns exec "$(ns h1)" unshare --uts sh -c 'hostname h1; exec "$@"' sh "$@"
}

cmd=${1:-}
shift || true
[[ "${1:-}" == "--" ]] && shift
case "$cmd" in
  up) up ;;
  down) down ;;
  run) run "$@" ;;
  with)
    trap down EXIT
    up
    run "$@"
    ;;
  *) echo "usage: $0 up|down|run -- CMD|with -- CMD" >&2; exit 2 ;;
esac
