#!/usr/bin/env bash
# mpiflow allreduce training beside PyTorch DDP (gloo) on the same MLP (784-1024-1024-10),
# batch 64 per rank, one BLAS/intra-op thread per rank, at 1, 2 and 4 ranks.
#
#   benches/compare/ddp.sh --install   # creates a virtual environment with torch (large)
#   benches/compare/ddp.sh             # uses $MPIFLOW_VENV (default .venv-bench)
#
# Prints samples/s of both and the ratio mpiflow/DDP. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${MPIFLOW_VENV:-.venv-bench}
STEPS=${STEPS:-300}
if [[ "${1:-}" == "--install" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "no torch in $VENV: run $0 --install (or set MPIFLOW_VENV)" >&2
  exit 1
fi
source scripts/env.sh
cargo build --release --quiet --bin mpiflow
printf '%-6s %16s %16s %8s %10s\n' "# ranks" "mpiflow samples/s" "DDP samples/s" "ratio" "comm share"
for n in 1 2 4; do
  out=$(timeout 600 mpirun -np "$n" target/release/mpiflow train --mode allreduce --data synthetic:784 \
    --hidden 1024,1024 --batch $((64 * n)) --blas-threads 1 --steps "$STEPS" --log-every $((STEPS / 3)) --check-every 0)
  last=$(echo "$out" | grep '^step' | tail -1)
  ours=$(echo "$last" | awk '{print $8}')
  comm=$(echo "$last" | awk '{print $10}')
  ddp=$(timeout 600 "$VENV/bin/python" -W ignore benches/compare/ddp_train.py --ranks "$n" --steps "$STEPS" | awk '{print $5}')
  ratio=$(awk -v a="$ours" -v b="$ddp" 'BEGIN { printf "%.2f", a / b }')
  printf '%-6s %16s %16s %8s %10s\n' "$n" "$ours" "$ddp" "$ratio" "$comm"
done
