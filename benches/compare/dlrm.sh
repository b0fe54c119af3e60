#!/usr/bin/env bash
# DLRM's training speed: mpiflow's hybrid mode (rows on the ps tasks, dense layers by
# allreduce) and ps mode beside PyTorch's DistributedDataParallel with
# EmbeddingBag(sparse=True) (benches/compare/dlrm_torch.py, gloo) and TensorFlow's
# ParameterServerStrategy with the tables sharded on its ps tasks
# (benches/compare/dlrm_tf.py), on the same model and table sizes: 13 dense features, FEATURES tables of ROWS rows x DIM, bottom and top MLPs
# of 64, global batch BATCH, Adam 0.003 on the dense layers and Adagrad on the rows, one
# BLAS/intra-op thread per process, 4 processes per job.
#
#   benches/compare/dlrm.sh                      # PyTorch from benches/python/torch-venv.sh,
#                                                # TensorFlow from benches/compare/tf.sh --install
#   ROUNDS=5 ROWS=1000000 benches/compare/dlrm.sh
#
# Each round runs, one job after another: mpiflow hybrid with 1 ps + 3 workers and with
# 2 ps + 2 workers, mpiflow ps (sync) with 1 ps + 3 workers, then PyTorch DDP on 4, 3 and
# 2 ranks, then TensorFlow with 1 ps + 3 workers and 2 ps + 2 workers (and its chief, the
# coordinator that dispatches the steps: 5 processes) where $MPIFLOW_TF_VENV (default
# ../venv-tf) has tensorflow; then the baselines, one process each without a cluster:
# mpiflow local, PyTorch on 1 rank, TensorFlow without its strategy. mpiflow's rate is its last logged window's samples/s (the first holds the
# start-up; its samples are made as it trains, inside the time); PyTorch's the global
# batch over the wall time of the steps after its warm-up (its batches made before);
# TensorFlow's the samples of the steps scheduled after its warm-up over their wall time. Prints
# each path's best and worst of ROUNDS and the best's ratio to PyTorch's best at 4 ranks.
# Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${MPIFLOW_TORCH_PYTHON:-$HOME/.cache/mpiflow/torch-venv/bin/python}
ROUNDS=${ROUNDS:-3}
FEATURES=${FEATURES:-8}
ROWS=${ROWS:-100000}
DIM=${DIM:-16}
BATCH=${BATCH:-1024}
STEPS=${STEPS:-400}
TORCH_STEPS=${TORCH_STEPS:-150}
TF_STEPS=${TF_STEPS:-300}
TF_VENV=${MPIFLOW_TF_VENV:-../venv-tf}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "no torch for $PYTHON: run benches/python/torch-venv.sh (or set MPIFLOW_TORCH_PYTHON)" >&2
  exit 1
fi
source scripts/env.sh
cargo build --release --quiet --bin mpiflow
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# mpiflow's samples/s: MODE PS, 4 processes (local: one).
ours() {
  local launch=(mpirun --oversubscribe -np 4)
  [[ $1 == local ]] && launch=()
  timeout 600 "${launch[@]}" target/release/mpiflow train --mode "$1" --ps "$2" \
    --model dlrm --data "synthetic-ctr:samples=2000000,features=$FEATURES,rows=$ROWS" \
    --embedding-dim "$DIM" --bottom 64 --top 64 --batch "$BATCH" --steps "$STEPS" \
    --blas-threads 1 --log-every $((STEPS / 4)) --progress lines >"$log" 2>&1 ||
    { tail -5 "$log" >&2; exit 1; }
  awk '/^step/ { v = $8 } END { if (v == "") exit 1; print v }' "$log"
}

# PyTorch's samples/s on N ranks.
theirs() {
  timeout 900 mpirun --oversubscribe -np "$1" "$PYTHON" benches/compare/dlrm_torch.py \
    --features "$FEATURES" --rows "$ROWS" --dim "$DIM" --batch "$BATCH" \
    --steps "$TORCH_STEPS" >"$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
  awk '/^torch samples/ { print $3 }' "$log"
}

# TensorFlow's samples/s with PS ps tasks and WORKERS workers (and the chief).
tensorflow() {
  local done="$log.done"
  rm -f "$done"
  TF_CPP_MIN_LOG_LEVEL=2 timeout 900 mpirun --oversubscribe -np $(($1 + $2 + 1)) \
    target/release/mpiflow launch --ps "$1" --chief -- "$TF_VENV/bin/python" -W ignore \
    benches/compare/dlrm_tf.py --features "$FEATURES" --rows "$ROWS" --dim "$DIM" \
    --batch "$BATCH" --steps "$TF_STEPS" --done-file "$done" >"$log" 2>&1 ||
    { grep -v '^WARNING' "$log" | tail -5 >&2; exit 1; }
  rm -f "$done"
  awk '/^tf samples/ { print $3 }' "$log"
}

# TensorFlow's samples/s in one process, without the strategy (the baseline).
tensorflow_local() {
  TF_CPP_MIN_LOG_LEVEL=2 timeout 900 "$TF_VENV/bin/python" -W ignore benches/compare/dlrm_tf.py \
    --local --features "$FEATURES" --rows "$ROWS" --dim "$DIM" --batch "$BATCH" \
    --steps "$TF_STEPS" >"$log" 2>&1 || { grep -v '^WARNING' "$log" | tail -5 >&2; exit 1; }
  awk '/^tf samples/ { print $3 }' "$log"
}

paths=("hybrid 1ps+3w" "hybrid 2ps+2w" "ps-sync 1ps+3w" "torch-ddp 4" "torch-ddp 3" "torch-ddp 2"
  "mpiflow local 1" "torch 1")
tf=false
if "$TF_VENV/bin/python" -c "import tensorflow" 2>/dev/null; then
  tf=true
  paths+=("tf-ps 1ps+3w" "tf-ps 2ps+2w" "tf local 1")
else
  echo "no tensorflow in $TF_VENV: TensorFlow's columns left out (benches/compare/tf.sh --install)" >&2
fi
declare -A all
for round in $(seq "$ROUNDS"); do
  all["hybrid 1ps+3w"]+=" $(ours hybrid 1)"
  all["hybrid 2ps+2w"]+=" $(ours hybrid 2)"
  all["ps-sync 1ps+3w"]+=" $(ours ps 1)"
  for n in 4 3 2; do all["torch-ddp $n"]+=" $(theirs "$n")"; done
  all["mpiflow local 1"]+=" $(ours local 0)"
  all["torch 1"]+=" $(theirs 1)"
  if $tf; then
    all["tf-ps 1ps+3w"]+=" $(tensorflow 1 3)"
    all["tf-ps 2ps+2w"]+=" $(tensorflow 2 2)"
    all["tf local 1"]+=" $(tensorflow_local)"
  fi
  echo "round $round done" >&2
done
best() { tr ' ' '\n' <<<"$1" | grep . | sort -g | tail -1; }
worst() { tr ' ' '\n' <<<"$1" | grep . | sort -g | head -1; }
ref=$(best "${all["torch-ddp 4"]}")
echo "# DLRM: $FEATURES tables of $ROWS x $DIM, batch $BATCH, best/worst of $ROUNDS rounds (samples/s)"
tf_ref=$($tf && best "${all["tf-ps 1ps+3w"]}" || echo 0)
printf '%-16s %10s %10s %8s %8s\n' path best worst "x torch4" "x tf1ps"
for p in "${paths[@]}"; do
  b=$(best "${all[$p]}")
  x_tf=$($tf && echo "$b / $tf_ref" | bc -l || echo nan)
  printf '%-16s %10.0f %10.0f %8.2f %8.2f\n' "$p" "$b" "$(worst "${all[$p]}")" \
    "$(echo "$b / $ref" | bc -l)" "$x_tf"
done
