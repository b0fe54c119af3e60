#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs a real 6-rank cluster here.
#   1. `mpiflow spec`: every rank gathers the hosts over MPI, probes a free port, and rank 0
#      prints the cluster table (2 ps, a chief, 3 workers).
#   2. `mpiflow launch`: the same mapping, each rank exec'ing a TensorFlow-style program
#      that reads TF_CONFIG as TensorFlow would and reports its role.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cargo build --release --quiet --bin mpiflow
BIN=target/release/mpiflow
NP=${MPIFLOW_NP:-6}

echo "== mpirun -np $NP mpiflow spec --ps 2 --chief"
timeout 120 mpirun -np "$NP" --hostfile hostfiles/localhost "$BIN" spec --ps 2 --chief

echo "== mpirun -np $NP mpiflow launch --ps 2 --chief -- python3 launcher/examples/check_role.py"
timeout 120 mpirun -np "$NP" --hostfile hostfiles/localhost "$BIN" launch --ps 2 --chief -- \
  python3 launcher/examples/check_role.py | sort
