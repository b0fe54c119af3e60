#!/usr/bin/env bash
# Builds mpiflow against MPICH (beside the default OpenMPI build) and runs under MPICH's
# mpiexec: a 3-rank `mpiflow spec` (every rank's task), `mpiflow check` (the data plane,
# shared memory and one-sided included), and training by the one-sided ps, the ps over
# messages and allreduce, each to 95% (the last two to the same accuracy).
# mpi-sys must be rebuilt for another MPI, hence the separate target directory.
# `mpich-check.sh build` only builds (the test command starts it early, in the background).
set -euo pipefail
cd "$(dirname "$0")/.."
MPIFLOW_WITH_MPICH=1 bash scripts/setup.sh
export MPICC=mpicc.mpich CARGO_TARGET_DIR=${MPIFLOW_MPICH_TARGET:-target/mpich}
# A first build starts from a copy of the OpenMPI release build, if there is one: every
# dependency but MPI's bindings is the same, so only mpi-sys (its build script reads
# MPICC, but cargo reruns it only when its sources change: hence the clean) and what
# depends on it are compiled again (here 63 s, against 135 s for everything).
if [[ ! -d $CARGO_TARGET_DIR/release && -d target/release/deps ]]; then
  mkdir -p "$CARGO_TARGET_DIR"
  cp -a target/release "$CARGO_TARGET_DIR/release"
  cargo clean --release --quiet -p mpi-sys
fi
# Resolved as the tests' build is (scripts/test.sh: with the Python package), so that the
# copy's dependencies are used as they are; mpiflow's own crate at opt-level 1: this build
# runs beside the Slurm tests, and a smoke run needs correct code, not the fastest.
cargo build --release --quiet -p mpiflow -p mpiflow-python --features pyo3/extension-module \
  --bin mpiflow --config 'profile.release.package.mpiflow.opt-level=1'
if ! ldd "$CARGO_TARGET_DIR/release/mpiflow" | grep libmpich >/dev/null; then
  echo "MPICH check failed: $CARGO_TARGET_DIR/release/mpiflow is not linked to MPICH"; exit 1
fi
if [[ "${1:-}" == build ]]; then
  exit 0
fi
out=$(timeout 120 mpiexec.mpich -n 3 "$CARGO_TARGET_DIR/release/mpiflow" spec --ps 1 --format tf-config | sort)
echo "$out"
want='"task":{"type":"ps","index":0}
"task":{"type":"worker","index":0}
"task":{"type":"worker","index":1}'
got=$(echo "$out" | grep -o '"task":{[^}]*}' | sort)
if [[ "$got" != "$want" ]]; then
  echo "MPICH check failed: tasks were:"; echo "$got"; exit 1
fi
# The whole data plane (point-to-point, collectives, shared memory, one-sided) under MPICH.
checked=$(timeout 120 mpiexec.mpich -n 3 "$CARGO_TARGET_DIR/release/mpiflow" check)
if [[ $(grep -c '"shm":true' <<<"$checked") != 3 ]]; then
  echo "MPICH check failed: the shared-memory allreduce did not run on every rank:"
  echo "$checked"; exit 1
fi
# Training under MPICH in each mode: the one-sided ps (its ch4 RMA; mpiflow's OpenMPI
# settings unused), the ps over messages and allreduce. Each must reach 95%; the two
# synchronous modes of the same global batch compute the same updates, so their accuracy
# lines (held-out samples right, at the same step) must be the same too.
train() {
  timeout 120 mpiexec.mpich -n "$1" "$CARGO_TARGET_DIR/release/mpiflow" train --steps 300 "${@:2}"
}
accuracy() {
  awk '/^accuracy/ {print $2}' <<<"$1"
}
rma=$(train 4 --mode ps --ps 1 --transport rma)
ps=$(train 4 --mode ps --ps 1)
allreduce=$(train 3 --mode allreduce)
for mode in rma ps allreduce; do
  acc=$(accuracy "${!mode}")
  if ! awk -v a="$acc" 'BEGIN {exit !(a >= 0.95)}'; then
    echo "MPICH check failed: $mode training reached accuracy '$acc'"; exit 1
  fi
done
if [[ $(grep '^accuracy' <<<"$ps") != $(grep '^accuracy' <<<"$allreduce") ]]; then
  echo "MPICH check failed: the synchronous ps and allreduce ended apart:"
  grep '^accuracy' <<<"$ps"; grep '^accuracy' <<<"$allreduce"; exit 1
fi
# A program that uses MPI itself under `mpiflow launch`: its own MPI_Init (MPICH's) works
# as its rank, its world is the whole job, and it sees its task.
prog=$CARGO_TARGET_DIR/mpi_allreduce
mpicc.mpich -O2 -o "$prog" launcher/examples/mpi_allreduce.c
launched=$(timeout 120 mpiexec.mpich -n 3 "$CARGO_TARGET_DIR/release/mpiflow" launch -- "$prog" | sort)
want=$(for r in 0 1 2; do echo "rank $r size 3 sum 6 task worker:$r tf_config yes"; done)
if [[ $launched != "$want" ]]; then
  echo "MPICH check failed: an MPI program under launch printed:"; echo "$launched"; exit 1
fi
# mpi4py (MPICH's ABI) with ps tasks that wait for ever without finalising MPI: the job
# ends when the workers are done. mpi4py's wheel opens MPICH as libmpi.so.12, which Debian
# names libmpich.so.12: a directory with that link goes first on the library path.
python=${MPIFLOW_PYTHON:-$(bash scripts/venv.sh)}
abi=$CARGO_TARGET_DIR/mpich-abi
mkdir -p "$abi"
ln -sf "$(ldconfig -p | awk '/libmpich\.so\.12 / {print $NF; exit}')" "$abi/libmpi.so.12"
launched=$(MPI4PY_MPIABI=mpich LD_LIBRARY_PATH=$abi${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  timeout 120 mpiexec.mpich -n 3 "$CARGO_TARGET_DIR/release/mpiflow" launch --ps 1 -- \
  "$python" launcher/examples/mpi4py_task.py --ps-joins | sort)
want="rank 0 size 3 sum 6 task ps:0 tf_config yes
rank 1 size 3 sum 6 task worker:0 tf_config yes
rank 2 size 3 sum 6 task worker:1 tf_config yes"
if [[ $launched != "$want" ]]; then
  echo "MPICH check failed: mpi4py with a ps task under launch printed:"; echo "$launched"; exit 1
fi
echo "MPICH: 7 passed, 0 failed"
