#!/usr/bin/env bash
# Installs what is missing and runs every test: formatting, lints, unit tests, and the
# integration tests under real mpirun (one at a time, each under a timeout), the
# multi-host test in network namespaces and the Slurm tests on a private Slurm (as root),
# and the MPICH build.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's wall time, said at the end (the whole is kept under 20 minutes).
times=() current=setup started=$SECONDS
phase() {
  times+=("$current $((SECONDS - started)) s")
  current=$1 started=$SECONDS
  echo "== $1"
}
MPIFLOW_WITH_MPICH=1 MPIFLOW_WITH_SLURM=1 bash scripts/setup.sh
source scripts/env.sh
# The Slurm tests (tests/slurm.rs) start a private Slurm; as root they must run, not skip.
if [[ $(id -u) -eq 0 ]]; then export MPIFLOW_REQUIRE_SLURM=1; fi

if cargo fmt --version >/dev/null 2>&1; then
  phase "cargo fmt --check"
  cargo fmt --all -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
  phase "cargo clippy"
  cargo clippy --release --all-targets --quiet -- -D warnings
fi

phase "cargo doc (no warnings)"
# --release: the dependencies' metadata is clippy's, just built (in the dev profile
# rustdoc would check every dependency again, about a minute here).
RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --quiet

phase "cargo test (OpenMPI)"
# The MPICH build (its own target directory) runs beside the tests at the lowest priority:
# they spend minutes waiting on Slurm, signals and timeouts, which it fills, and it takes
# the CPU from them only when they leave it idle. It builds once the tests are built.
log=$(mktemp) mpich_log=$(mktemp)
# Its own session, so that an early exit stops the whole build (cargo and its rustc).
trap 'rm -f "$log" "$mpich_log"; [[ -n ${mpich_pid:-} ]] && kill -- "-$mpich_pid" 2>/dev/null || true' EXIT
cargo test --release --no-run --quiet
setsid nice -n 19 bash scripts/mpich-check.sh build >"$mpich_log" 2>&1 &
mpich_pid=$!
# One test thread: the mpirun tests must not run at once on 2 cores.
timeout 1500 cargo test --release -- --test-threads=1 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [[ $status -ne 0 ]]; then
  exit "$status"
fi

phase "MPICH build and smoke run"
if ! wait "$mpich_pid"; then
  mpich_pid=
  echo "MPICH build failed:"; cat "$mpich_log"; exit 1
fi
mpich_pid=
bash scripts/mpich-check.sh | tee -a "$log"

# One closing line over everything that ran.
passed=$(grep -Eo '([0-9]+) passed' "$log" | awk '{s += $1} END {print s + 0}')
failed=$(grep -Eo '([0-9]+) failed' "$log" | awk '{s += $1} END {print s + 0}')
phase done
echo "mpiflow: $passed passed, $failed failed in $SECONDS s ($(IFS=,; echo "${times[*]}" | sed 's/,/, /g'))"
