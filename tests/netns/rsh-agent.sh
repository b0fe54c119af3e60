#!/usr/bin/env bash
# OpenMPI's rsh agent for the namespace hosts: `rsh-agent.sh HOST CMD...` runs CMD inside
# the namespace of HOST with that hostname, as ssh would run it on a real host.
set -euo pipefail
host=$1
shift
exec ip netns exec "${MPIFLOW_NETNS_PREFIX:-mpiflow}-$host" unshare --uts sh -c "hostname $host; $*"
