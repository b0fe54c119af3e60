#!/usr/bin/env bash
# DLRM's rows over messages beside rows over one-sided windows (--transport rma), the same
# model and data as benches/compare/dlrm.sh (FEATURES tables of ROWS rows x DIM, MLPs of
# 64, global batch BATCH, Adagrad on the rows, Adam on the dense layers, one BLAS thread),
# 4 processes per job: hybrid with 1 ps + 3 workers and 2 ps + 2 workers, ps (sync) with
# 1 ps + 3 workers; each path over p2p then rma, one job after another, ROUNDS rounds.
# Prints every job's samples/s (its last logged window's, as dlrm.sh) and each path's best.
#
#   ROUNDS=3 benches/compare/dlrm_windows.sh
#
# Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-3}
FEATURES=${FEATURES:-8}
ROWS=${ROWS:-100000}
DIM=${DIM:-16}
BATCH=${BATCH:-1024}
STEPS=${STEPS:-400}
source scripts/env.sh
cargo build --release --quiet --bin mpiflow
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
declare -A best

# samples/s of MODE with PS ps tasks over TRANSPORT.
run() {
  timeout 600 mpirun --oversubscribe -np 4 target/release/mpiflow train --mode "$1" --ps "$2" \
    --transport "$3" --model dlrm \
    --data "synthetic-ctr:samples=2000000,features=$FEATURES,rows=$ROWS" \
    --embedding-dim "$DIM" --bottom 64 --top 64 --batch "$BATCH" --steps "$STEPS" \
    --blas-threads 1 --log-every $((STEPS / 4)) --progress lines >"$log" 2>&1 ||
    { tail -5 "$log" >&2; exit 1; }
  awk '/^step/ { v = $8 } END { if (v == "") exit 1; print v }' "$log"
}

for round in $(seq "$ROUNDS"); do
  for path in "hybrid 1" "hybrid 2" "ps 1"; do
    for transport in p2p rma; do
      # shellcheck disable=SC2086
      v=$(run $path "$transport")
      key="$path $transport"
      echo "round $round: $key: $v samples/s"
      if [[ -z ${best[$key]:-} ]] || awk -v a="$v" -v b="${best[$key]}" 'BEGIN { exit !(a > b) }'; then
        best[$key]=$v
      fi
    done
  done
done
for path in "hybrid 1" "hybrid 2" "ps 1"; do
  p=${best["$path p2p"]} r=${best["$path rma"]}
  awk -v k="$path" -v p="$p" -v r="$r" 'BEGIN { printf "%s ps: messages %d, windows %d, windows/messages %.2f\n", k, p, r, r / p }'
done
