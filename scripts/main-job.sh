#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs a real multi-rank training run
# on this machine:
#   1. `mpiflow spec`: every rank gathers the hosts over MPI, probes a free port, and rank 0
#      prints the cluster table (2 ps, a chief, 3 workers).
#   2. `mpiflow train --mode ps`: synchronous parameter-server training of an MLP on the
#      UCI digits data with those 6 ranks, checkpointing, then the held-out accuracy.
#   3. `mpiflow launch`: the same mapping, each rank exec'ing a TensorFlow-style program
#      that reads TF_CONFIG as TensorFlow would and reports its role.
#   4. `examples/fashion.rs`, a program of one's own on the library: a CNN trained on
#      Fashion-MNIST by 4 allreduce replicas, evaluated every 200 steps on the 10,000 test
#      images, stopped once it reaches 90%.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cargo build --release --quiet --bin mpiflow --example fashion
BIN=target/release/mpiflow
NP=${MPIFLOW_NP:-6}
CKPT=${MPIFLOW_CHECKPOINT_DIR:-$(mktemp -d)}

echo "== mpirun -np $NP mpiflow spec --ps 2 --chief"
timeout 120 mpirun -np "$NP" --hostfile hostfiles/localhost "$BIN" spec --ps 2 --chief

echo "== mpirun -np $NP mpiflow train --mode ps --ps 2 --chief --checkpoint-dir $CKPT"
timeout 300 mpirun -np "$NP" --hostfile hostfiles/localhost "$BIN" train --mode ps --ps 2 --chief \
  --checkpoint-dir "$CKPT" --checkpoint-every 500

# The job stops its ps tasks once the workers end: --ps-ready makes the workers wait for
# the ps tasks' lines first, so that every task's line shows.
ready=$(mktemp -d)
trap 'rm -rf "$ready"' EXIT
echo "== mpirun -np $NP mpiflow launch --ps 2 --chief -- python3 launcher/examples/check_role.py --ps-ready DIR"
timeout 120 mpirun -np "$NP" --hostfile hostfiles/localhost "$BIN" launch --ps 2 --chief -- \
  python3 launcher/examples/check_role.py --ps-ready "$ready" | sort

echo "== mpirun -np 4 target/release/examples/fashion (the CNN on Fashion-MNIST to 90%)"
timeout 300 mpirun --oversubscribe -np 4 target/release/examples/fashion
