#!/usr/bin/env bash
# Installs what is missing and runs every test: formatting, lints, unit tests, and the
# integration tests under real mpirun (one at a time, each under a timeout), the
# multi-host test in network namespaces and the Slurm tests on a private Slurm (as root),
# and the MPICH build.
set -euo pipefail
cd "$(dirname "$0")/.."
MPIFLOW_WITH_MPICH=1 MPIFLOW_WITH_SLURM=1 bash scripts/setup.sh
source scripts/env.sh
# The Slurm tests (tests/slurm.rs) start a private Slurm; as root they must run, not skip.
if [[ $(id -u) -eq 0 ]]; then export MPIFLOW_REQUIRE_SLURM=1; fi

if cargo fmt --version >/dev/null 2>&1; then
  echo "== cargo fmt --check"
  cargo fmt --all -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
  echo "== cargo clippy"
  cargo clippy --release --all-targets --quiet -- -D warnings
fi

echo "== cargo doc (no warnings)"
# --release: the dependencies' metadata is clippy's, just built (in the dev profile
# rustdoc would check every dependency again, about a minute here).
RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --quiet

echo "== cargo test (OpenMPI)"
# One test thread: the mpirun tests must not run at once on 2 cores.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
timeout 1500 cargo test --release -- --test-threads=1 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [[ $status -ne 0 ]]; then
  exit "$status"
fi

echo "== MPICH build and smoke run"
bash scripts/mpich-check.sh | tee -a "$log"

# One closing line over everything that ran.
passed=$(grep -Eo '([0-9]+) passed' "$log" | awk '{s += $1} END {print s + 0}')
failed=$(grep -Eo '([0-9]+) failed' "$log" | awk '{s += $1} END {print s + 0}')
echo "mpiflow: $passed passed, $failed failed"
