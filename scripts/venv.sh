#!/usr/bin/env bash
# Makes the Python environment the tests run Python programs in (quiet when it is there):
# a virtual environment at $MPIFLOW_VENV (default target/venv) with mpi4py (the tests of
# MPI programs under `mpiflow launch`) and this repository's Python package, `mpiflow`,
# built by maturin (`pip install .`; cargo's incremental build, so a few seconds when
# nothing changed). Prints the environment's python.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MPIFLOW_VENV:-target/venv}
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv" >&2
fi
if ! "$venv/bin/python" -c 'import mpi4py' 2>/dev/null; then
  echo "mpiflow venv: installing mpi4py into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check 'mpi4py>=4,<5' >&2
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check . >&2
echo "$(cd "$venv" && pwd)/bin/python"
