#!/usr/bin/env bash
# mpiflow's parameter-server training beside TensorFlow's own (TF1 between-graph
# replication over gRPC, benches/compare/tf_ps_train.py, launched by `mpiflow launch`) on
# the same task: an MLP of HIDDEN widths on 784 random inputs, 10 classes, Adam 0.003,
# 64 samples per worker per step, one BLAS/intra-op thread per task, 1 ps and WORKERS
# workers, sync (TensorFlow's SyncReplicasOptimizer) and async.
#
#   benches/compare/tf.sh --install   # creates $MPIFLOW_TF_VENV with tensorflow-cpu (large)
#   benches/compare/tf.sh             # uses $MPIFLOW_TF_VENV (default ../venv-tf)
#   ROUNDS=5 HIDDEN=256 WORKERS=3 STEPS=600 benches/compare/tf.sh
#
# Each round runs mpiflow's ps over messages (--transport p2p), over one-sided windows
# (rma; sync only: its async updates are plain SGD), then TensorFlow's (alternating jobs); prints the job's samples/s of each (mpiflow:
# its last logged window; TensorFlow: the sum of the workers' rates after their warm-up
# steps), the best of ROUNDS each with the worst beside it, and the ratios of bests to
# TensorFlow's. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${MPIFLOW_TF_VENV:-../venv-tf}
STEPS=${STEPS:-300}
HIDDEN=${HIDDEN:-1024,1024}
WORKERS=${WORKERS:-3}
ROUNDS=${ROUNDS:-3}
if [[ "${1:-}" == "--install" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q tensorflow-cpu
fi
if ! "$VENV/bin/python" -c "import tensorflow" 2>/dev/null; then
  echo "no tensorflow in $VENV: run $0 --install (or set MPIFLOW_TF_VENV)" >&2
  exit 1
fi
source scripts/env.sh
cargo build --release --quiet --bin mpiflow
np=$((WORKERS + 1))
mpirun_args=(--oversubscribe -np "$np")
export TF_CPP_MIN_LOG_LEVEL=2

log=$(mktemp) err=$(mktemp)
trap 'rm -f "$log" "$err"' EXIT
# Runs a job, its stdout into $log and its stderr into $err; on a failure shows their
# ends and stops.
job() {
  # Apart: a line on stdout may start while another thread's is half out on stderr.
  if ! timeout 600 mpirun "${mpirun_args[@]}" "$@" >"$log" 2>"$err"; then
    failed "mpirun ${mpirun_args[*]} $*"
  fi
}
failed() {
  echo "failed: $1" >&2
  cat "$log" "$err" | grep -v '^  \|^WARNING\|^Instructions\|^$' | tail -20 >&2
  exit 1
}

# mpiflow's samples/s (MODE TRANSPORT): the last logged window (the first one holds the
# start-up).
ours() {
  job target/release/mpiflow train --mode ps --ps 1 "$1" --transport "$2" --data synthetic:784 \
    --hidden "$HIDDEN" --batch $((64 * WORKERS)) --blas-threads 1 --steps "$STEPS" \
    --log-every $((STEPS / 3))
  awk '/^step/ { v = $8 } END { if (v == "") exit 1; print v }' "$log" ||
    failed "no step line from mpiflow train"
}

# TensorFlow's: the sum of its workers' rates. A global step is an update in both: one
# per step of every worker in sync, one per push in async.
theirs() {
  job target/release/mpiflow launch --ps 1 --legacy-flags -- "$VENV/bin/python" -W ignore \
    benches/compare/tf_ps_train.py --hidden "$HIDDEN" --batch 64 --steps "$STEPS" "$1"
  awk -v w="$WORKERS" '/^tf worker/ { s += $5; n++ } END { if (n != w) exit 1; printf "%.1f\n", s }' \
    "$log" || failed "not a rate from each of the $WORKERS TensorFlow workers"
}

# best worst (of higher-is-better values)
best_worst() { tr ' ' '\n' | awk 'NF { if (b == "" || $1 > b) b = $1; if (w == "" || $1 < w) w = $1 } END { print b, w }'; }

printf '%-6s %22s %22s %22s %8s %8s\n' "# mode" "mpiflow p2p samples/s" "mpiflow rma samples/s" \
  "TensorFlow samples/s" "p2p/TF" "rma/TF"
for mode in sync async; do
  p2p_v='' rma_v='' tf_v=''
  for _ in $(seq "$ROUNDS"); do
    p2p_v+=" $(ours "--$mode" p2p)"
    # Asynchronous updates through windows are plain SGD (MPI_Accumulate), not Adam.
    if [[ $mode == sync ]]; then rma_v+=" $(ours "--$mode" rma)"; fi
    tf_v+=" $(theirs "--$mode")"
  done
  read -r pb pw <<<"$(echo "$p2p_v" | best_worst)"
  read -r tb tw <<<"$(echo "$tf_v" | best_worst)"
  ratio() { awk -v a="$1" -v b="$tb" 'BEGIN { printf "%.2f", a / b }'; }
  rma="n/a (SGD only)" rma_ratio=-
  if [[ -n $rma_v ]]; then
    read -r rb rw <<<"$(echo "$rma_v" | best_worst)"
    rma="$rb (worst $rw)" rma_ratio=$(ratio "$rb")
  fi
  printf '%-6s %22s %22s %22s %8s %8s\n' "$mode" "$pb (worst $pw)" "$rma" "$tb (worst $tw)" \
    "$(ratio "$pb")" "$rma_ratio"
done
