#!/usr/bin/env bash
# mpiflow allreduce training beside PyTorch DDP (gloo) on the same network, batch 64 per
# rank, one BLAS/intra-op thread per rank, at 1, 2 and 4 ranks: MODEL=mlp (784-1024-1024-10,
# synthetic data) or MODEL=cnn (mpiflow's CNN on Fashion-MNIST's 28x28 images).
#
#   benches/compare/ddp.sh --install   # creates a virtual environment with torch (large)
#   benches/compare/ddp.sh             # uses $MPIFLOW_VENV (default .venv-bench)
#   MODEL=cnn ROUNDS=3 benches/compare/ddp.sh
#
# Prints samples/s of both, best of ROUNDS alternating runs each, and the ratio
# mpiflow/DDP. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${MPIFLOW_VENV:-.venv-bench}
STEPS=${STEPS:-300}
MODEL=${MODEL:-mlp}
ROUNDS=${ROUNDS:-1}
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
if [[ $MODEL == cnn ]]; then
  model_args=(--model cnn --data fashion-mnist)
else
  model_args=(--data synthetic:784 --hidden 1024,1024)
fi
printf '%-6s %16s %16s %8s %10s\n' "# ranks" "mpiflow samples/s" "DDP samples/s" "ratio" "comm share"
for n in 1 2 4; do
  best_ours=0 best_ddp=0 comm=
  for _ in $(seq "$ROUNDS"); do
    out=$(timeout 600 mpirun -np "$n" target/release/mpiflow train --mode allreduce "${model_args[@]}" \
      --batch $((64 * n)) --blas-threads 1 --steps "$STEPS" --log-every $((STEPS / 3)) --check-every 0)
    last=$(echo "$out" | grep '^step' | tail -1)
    ours=$(echo "$last" | awk '{print $8}')
    ddp=$(timeout 600 "$VENV/bin/python" -W ignore benches/compare/ddp_train.py --model "$MODEL" \
      --ranks "$n" --steps "$STEPS" | awk '{print $5}')
    if awk -v a="$ours" -v b="$best_ours" 'BEGIN { exit !(a > b) }'; then
      best_ours=$ours comm=$(echo "$last" | awk '{print $10}')
    fi
    if awk -v a="$ddp" -v b="$best_ddp" 'BEGIN { exit !(a > b) }'; then best_ddp=$ddp; fi
  done
  ratio=$(awk -v a="$best_ours" -v b="$best_ddp" 'BEGIN { printf "%.2f", a / b }')
  printf '%-6s %16s %16s %8s %10s\n' "$n" "$best_ours" "$best_ddp" "$ratio" "$comm"
done
