#!/usr/bin/env bash
# Makes (or updates) the virtual environment with PyTorch that the PyTorch tests and
# benchmarks use, outside the repository: $MPIFLOW_TORCH_VENV (default
# ~/.cache/mpiflow/torch-venv) with torch (PyPI's, several GB), mpi4py and this
# repository's `mpiflow` package. Prints the environment's python. The tests find it
# there (or by $MPIFLOW_TORCH_PYTHON) and skip the PyTorch tests where it is missing.
#
#   bash benches/python/torch-venv.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${MPIFLOW_TORCH_VENV:-$HOME/.cache/mpiflow/torch-venv}
pip=(-m pip install --quiet --disable-pip-version-check)
if [[ ! -x $venv/bin/python ]]; then
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" >&2
fi
if ! "$venv/bin/python" -c 'import torch, mpi4py' 2>/dev/null; then
  echo "torch venv: installing torch and mpi4py into $venv (large)" >&2
  "$venv/bin/python" "${pip[@]}" torch 'mpi4py>=4,<5' numpy >&2
fi
"$venv/bin/python" "${pip[@]}" . >&2
echo "$(cd "$venv" && pwd)/bin/python"
