#!/usr/bin/env bash
# A private Slurm on loopback, from nothing: munge with a fresh key, slurmctld, and four
# slurmd daemons as four fake nodes node[1-4] on this one machine. All state lives under
# one directory; every daemon is stopped by its pidfile.
#
#   launcher/local-slurm.sh up DIR          start (DIR is created; its env file is DIR/env)
#   launcher/local-slurm.sh down DIR        cancel jobs, stop every daemon, keep the logs
#   launcher/local-slurm.sh with -- CMD...  up in a new temporary directory, run CMD with
#                                           SLURM_CONF set, and down even if CMD fails
#
# For tests and for trying the templates in launcher/slurm/ without a real cluster.
# Needs root (slurmd runs jobs as their user) and the packages slurmctld slurmd
# slurm-client munge (`MPIFLOW_WITH_SLURM=1 scripts/setup.sh`).
#
# Fake nodes share one hostname. These settings make that work, and are test-only:
# - A TaskProlog gives each node its own TMPDIR and, inside steps, its own OpenMPI
#   shared-memory directory (otherwise the backing files of "different nodes" collide).
# - It also exports MPIFLOW_HOST=$SLURMD_NODENAME, so mpiflow names hosts node1..node4
#   instead of the one real hostname. Real clusters have distinct hostnames: never set
#   MPIFLOW_HOST there.
# - PMIx fences by ring (mpi.conf): with Slurm's default, about 1 step in 10 of 8 ranks on
#   these fake nodes had a rank crash in MPI_Init (see write_config).
# - OMPI_MCA_mpi_yield_when_idle=1, because the fake nodes oversubscribe the real cores,
#   and OpenMPI's TCP kept on loopback.
# And no default CPU binding (TaskPluginParam=None): Slurm would bind task k of every fake
# node to the same real core, and 4-8 ranks on one core made OpenMPI's TCP connection
# setup time out and crash (open-mpi/ompi#11508). An explicit --cpu-bind still applies.
#
# Ports: slurmctld on $MPIFLOW_SLURM_PORT (default 16817), slurmd on the next four.
set -euo pipefail

PORT=${MPIFLOW_SLURM_PORT:-16817}
NODES=4
HOST=$(hostname -s)

die() { echo "local-slurm: $*" >&2; exit 1; }

need() {
  for c in munged slurmctld slurmd sbatch scontrol sinfo; do
    command -v "$c" >/dev/null || die "$c not found: run MPIFLOW_WITH_SLURM=1 scripts/setup.sh"
  done
  [[ $(id -u) -eq 0 ]] || die "needs root (slurmd starts job steps as their user)"
}

write_config() {
  local d=$1
  mkdir -p "$d"/{state,log,run,tmp}
  for n in $(seq "$NODES"); do mkdir -p "$d/spool/node$n" "$d/tmp/node$n"; done
  cat >"$d/slurm.conf" <<EOF
ClusterName=mpiflow
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/run/munge.socket
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool/%n
SlurmctldPidFile=$d/run/slurmctld.pid
SlurmdPidFile=$d/run/slurmd-%n.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=None
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
ReturnToService=2
TmpFS=$d/tmp/%n
TaskProlog=$d/task-prolog.sh
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
# A task that dies ends its step (srun -K for every step): the other ranks would otherwise
# wait in MPI for it until the job's time limit.
KillOnBadExit=1
KillWait=5
MinJobAge=300
NodeName=node[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[$((PORT + 1))-$((PORT + NODES))] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  # Lines a TaskProlog prints as `export K=V` enter the task's environment.
  cat >"$d/task-prolog.sh" <<EOF
#!/bin/sh
echo "export TMPDIR=$d/tmp/\$SLURMD_NODENAME"
echo "export MPIFLOW_HOST=\$SLURMD_NODENAME"
# The daemons' marker, so that \`down\` also finds what the jobs started.
echo "export MPIFLOW_LOCAL_SLURM=$d"
# Four fake nodes of 2 CPUs share 2 real cores: OpenMPI must yield while it waits, as it
# does by itself when it knows a node is oversubscribed (busy-polling ranks ran 60x slower).
echo "export OMPI_MCA_mpi_yield_when_idle=1"
# "Nodes" talk over TCP between each other: keep OpenMPI on loopback, the only network
# these tests may use.
echo "export OMPI_MCA_btl_tcp_if_include=lo"
echo "export OMPI_MCA_oob_tcp_if_include=lo"
# A directory per node and per run of a job: a requeued job keeps its id, and its steps'
# segment files would carry the names of the first run's (named after the job and step).
if [ -n "\$SLURM_STEP_ID" ]; then
  vader=$d/tmp/\$SLURMD_NODENAME/vader.\$SLURM_JOB_ID.\${SLURM_RESTART_COUNT:-0}
  mkdir -p "\$vader"
  echo "export OMPI_MCA_btl_vader_backing_directory=\$vader"
fi
EOF
  chmod 755 "$d/task-prolog.sh"
  # PMIx fences between the fake nodes' stepds by the ring algorithm. With the default
  # (mixed, tree for small fences) about 1 step in 10 of 8 ranks on 4 fake nodes had a
  # rank leave MPI_Init's closing fence while another was still before its PML setup: the
  # first message reached a process with no handler registered and it died of SIGSEGV in
  # MPI_Init (a C MPI_Init/MPI_Allreduce program too: 15 of 180 steps with mixed or tree,
  # 0 of 300 with ring, measured with two CPU hogs beside).
  echo "PMIxCollFence=ring" >"$d/mpi.conf"
  echo "export SLURM_CONF=$d/slurm.conf" >"$d/env"
}

# Runs a daemon with a marker in its environment, so that `down` can find the
# slurmstepd processes it forked (they have no pidfile).
daemon() {
  local d=$1
  shift
  env MPIFLOW_LOCAL_SLURM="$d" SLURM_CONF="$d/slurm.conf" "$@"
}

wait_for() {
  local what=$1 tries=$2
  shift 2
  for _ in $(seq "$tries"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  die "$what did not come up; logs in $LOGDIR"
}

all_idle() {
  local states
  states=$(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')
  [[ "$states" == "idle " ]]
}

up() {
  local d
  d=$(realpath -m "$1")
  need
  LOGDIR="$d/log"
  # Another Slurm on these ports would answer for this one (its nodes, its jobs).
  local p
  for p in $(seq "$PORT" $((PORT + NODES))); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      die "port $p is taken (another local Slurm? MPIFLOW_SLURM_PORT picks other ports)"
    fi
  done
  write_config "$d"
  export SLURM_CONF="$d/slurm.conf"
  # A fresh key: 1 KiB of random bytes, readable by its owner only.
  head -c 1024 /dev/urandom >"$d/run/munge.key"
  chmod 400 "$d/run/munge.key"
  chmod 700 "$d/run"
  daemon "$d" munged --force --socket="$d/run/munge.socket" --key-file="$d/run/munge.key" \
    --pid-file="$d/run/munged.pid" --log-file="$d/log/munged.log" --seed-file="$d/run/munge.seed"
  wait_for munged 50 test -S "$d/run/munge.socket"
  daemon "$d" slurmctld -i -f "$d/slurm.conf"
  wait_for slurmctld 100 scontrol ping
  for n in $(seq "$NODES"); do
    daemon "$d" slurmd -N "node$n" -f "$d/slurm.conf"
  done
  wait_for "the four nodes" 150 all_idle
}

# Whether process PID runs: it exists and is not a zombie (dead, its exit status not yet
# collected by its parent; a daemon's parent is init, which can take seconds to do it).
running() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  # The state follows the command name, which is in parentheses and may hold spaces.
  [[ ${stat##*) } != Z* ]]
}

# Stops the daemons of the given pidfiles together: SIGTERM, up to 5 s, then SIGKILL.
stop_pidfiles() {
  local f pid pids=()
  for f in "$@"; do
    [[ -f "$f" ]] || continue
    pid=$(cat "$f" 2>/dev/null || true)
    if [[ -n "$pid" ]] && running "$pid"; then
      kill "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
    rm -f "$f"
  done
  for _ in $(seq 50); do
    local alive=0
    for pid in "${pids[@]}"; do running "$pid" && alive=1; done
    ((alive)) || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

down() {
  local d
  d=$(realpath -m "$1")
  [[ -d "$d" ]] || return 0
  export SLURM_CONF="$d/slurm.conf"
  # Jobs first, while the daemons can still end them cleanly.
  if [[ -S "$d/run/munge.socket" ]] && scontrol ping >/dev/null 2>&1; then
    scancel --quiet --full --user=root 2>/dev/null || true
    for _ in $(seq 25); do
      [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
      sleep 0.2
    done
  fi
  stop_pidfiles "$d"/run/slurmd-*.pid "$d/run/slurmctld.pid"
  # Step daemons and job tasks (all carry the marker) that outlived their slurmd; then
  # wait until they are gone, not merely signalled. Pass after pass until one finds none:
  # a step daemon can fork a job's task after a pass has listed /proc and before it is
  # killed (a job's `sleep` once survived a single pass).
  local p alive
  for _ in $(seq 10); do
    local left=()
    for p in /proc/[0-9]*; do
      if grep -qxzF "MPIFLOW_LOCAL_SLURM=$d" "$p/environ" 2>/dev/null; then
        kill -9 "${p#/proc/}" 2>/dev/null || true
        left+=("$p")
      fi
    done
    ((${#left[@]})) || break
    for _ in $(seq 50); do
      alive=0
      for p in "${left[@]}"; do running "${p#/proc/}" && alive=1; done
      ((alive)) || break
      sleep 0.1
    done
  done
  stop_pidfiles "$d/run/munged.pid"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) [[ $# -eq 1 ]] || die "usage: $0 up DIR"; up "$1" ;;
  down) [[ $# -eq 1 ]] || die "usage: $0 down DIR"; down "$1" ;;
  with)
    [[ "${1:-}" == "--" ]] && shift
    [[ $# -ge 1 ]] || die "usage: $0 with -- CMD..."
    DIR=$(mktemp -d /tmp/mpiflow-slurm.XXXXXX)
    trap 'down "$DIR"; rm -rf "$DIR"' EXIT
    up "$DIR"
    export SLURM_CONF="$DIR/slurm.conf"
    "$@"
    ;;
  *) die "usage: $0 up DIR | down DIR | with -- CMD..." ;;
esac
