#!/usr/bin/env bash
# Installs what is missing and runs every test: formatting, lints, unit tests, and the
# integration tests under real mpirun (one at a time, each under a timeout), the
# multi-host test in network namespaces (as root), and the MPICH build.
set -euo pipefail
cd "$(dirname "$0")/.."
MPIFLOW_WITH_MPICH=1 bash scripts/setup.sh
source scripts/env.sh

if cargo fmt --version >/dev/null 2>&1; then
  echo "== cargo fmt --check"
  cargo fmt --all -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
  echo "== cargo clippy"
  cargo clippy --release --all-targets --quiet -- -D warnings
fi

echo "== cargo test (OpenMPI)"
# One test thread: the mpirun tests must not run at once on 2 cores.
timeout 1500 cargo test --release -- --test-threads=1

echo "== MPICH build and smoke run"
bash scripts/mpich-check.sh
