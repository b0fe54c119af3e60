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
# Python programs under test (mpi4py under `launch`) run in the environment venv.sh makes.
MPIFLOW_PYTHON=$(bash scripts/venv.sh)
export MPIFLOW_PYTHON MPIFLOW_REQUIRE_PYTHON=1
# The PyTorch tests run where benches/python/torch-venv.sh made its environment (outside
# the repository); this tree's package is installed into it first.
torch_venv=${MPIFLOW_TORCH_VENV:-$HOME/.cache/mpiflow/torch-venv}
if [[ -z ${MPIFLOW_TORCH_PYTHON:-} && -x $torch_venv/bin/python ]]; then
  MPIFLOW_TORCH_PYTHON=$(bash benches/python/torch-venv.sh)
  export MPIFLOW_TORCH_PYTHON
fi
# The Slurm tests (tests/slurm.rs) start a private Slurm, the multi-host test network
# namespaces, others mounts: as root they must run, not skip (tests/common: as_root).
if [[ $(id -u) -eq 0 ]]; then export MPIFLOW_REQUIRE_SLURM=1 MPIFLOW_REQUIRE_ROOT=1; fi

if cargo fmt --version >/dev/null 2>&1; then
  phase "cargo fmt --check"
  cargo fmt --all -- --check
fi
if cargo clippy --version >/dev/null 2>&1; then
  phase "cargo clippy"
  cargo clippy --release --workspace --all-targets --quiet -- -D warnings
fi

phase "cargo doc (no warnings)"
# --release: the dependencies' metadata is clippy's, just built (in the dev profile
# rustdoc would check every dependency again, about a minute here).
RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --quiet

phase "cargo test (OpenMPI)"
# The tests' build selects the Python package too, with maturin's feature: it then resolves
# every shared dependency as the package's build (venv.sh, above) did and reuses what that
# compiled, mpiflow's library included, instead of compiling them all a second time.
packages=(-p mpiflow -p mpiflow-python --features pyo3/extension-module)
log=$(mktemp) mpich_log=$(mktemp)
# The MPICH build runs in its own session, so that an early exit stops all of it.
trap 'rm -f "$log" "$mpich_log"; [[ -n ${mpich_pid:-} ]] && kill -- "-$mpich_pid" 2>/dev/null || true' EXIT
# One test thread: the mpirun tests must not run at once on 2 cores. A failure ends the
# script with cargo's status (set -e, pipefail).
run_tests() {
  timeout 1500 cargo test --release "${packages[@]}" "$@" -- --test-threads=1 2>&1 | tee -a "$log"
}
cargo test --release "${packages[@]}" --no-run --quiet
# The Slurm tests first, with the MPICH build (its own target directory) beside them at
# the lowest priority: they wait on Slurm's scheduler and time limits for most of their
# two minutes, which the build fills. (Beside the CPU-bound tests it cost them more than
# it saved, when its group below was at nice 0: ranks that yield the CPU while they wait
# gave it to the build.) Its own session is its own scheduling group where the kernel
# groups by session (autogroup): that group's nice is what ranks it against the tests'
# jobs (Slurm's steps run in other sessions), so it is set too.
setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null
  exec nice -n 19 bash scripts/mpich-check.sh build' >"$mpich_log" 2>&1 &
mpich_pid=$!
run_tests --test slurm
if ! wait "$mpich_pid"; then
  mpich_pid=
  echo "MPICH build failed:"; cat "$mpich_log"; exit 1
fi
mpich_pid=
# Then everything else: the unit tests, every other integration test, the doctests.
others=(--lib --bins)
for f in tests/*.rs; do
  name=$(basename "$f" .rs)
  if [[ $name != slurm ]]; then others+=(--test "$name"); fi
done
run_tests "${others[@]}"
run_tests --doc

phase "MPICH smoke run"
bash scripts/mpich-check.sh | tee -a "$log"

# One closing line over everything that ran.
passed=$(grep -Eo '([0-9]+) passed' "$log" | awk '{s += $1} END {print s + 0}')
failed=$(grep -Eo '([0-9]+) failed' "$log" | awk '{s += $1} END {print s + 0}')
phase done
echo "mpiflow: $passed passed, $failed failed in $SECONDS s ($(IFS=,; echo "${times[*]}" | sed 's/,/, /g'))"
