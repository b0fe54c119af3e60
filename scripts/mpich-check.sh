#!/usr/bin/env bash
# Builds mpiflow against MPICH (beside the default OpenMPI build) and runs a 3-rank
# `mpiflow spec` under MPICH's mpiexec, checking every rank's task.
# mpi-sys must be rebuilt for another MPI, hence the separate target directory.
set -euo pipefail
cd "$(dirname "$0")/.."
MPIFLOW_WITH_MPICH=1 bash scripts/setup.sh
export MPICC=mpicc.mpich CARGO_TARGET_DIR=${MPIFLOW_MPICH_TARGET:-target/mpich}
cargo build --release --quiet --bin mpiflow
out=$(timeout 120 mpiexec.mpich -n 3 "$CARGO_TARGET_DIR/release/mpiflow" spec --ps 1 --format tf-config | sort)
echo "$out"
want='"task":{"type":"ps","index":0}
"task":{"type":"worker","index":0}
"task":{"type":"worker","index":1}'
got=$(echo "$out" | grep -o '"task":{[^}]*}' | sort)
if [[ "$got" != "$want" ]]; then
  echo "MPICH check failed: tasks were:"; echo "$got"; exit 1
fi
echo "MPICH: 1 passed, 0 failed"
