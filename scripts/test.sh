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
log=$(mktemp) later_log=$(mktemp) targets=$(mktemp)
# The background builds run in their own session, so that an early exit stops all of it.
trap 'rm -f "$log" "$later_log" "$targets" "$targets.lib"; [[ -n ${later_pid:-} ]] && kill -- "-$later_pid" 2>/dev/null || true' EXIT
# Built first: the examples some tests run, every integration test (the Slurm ones first)
# and the binary. The library's unit tests are built later, beside the integration tests:
# their build is the longest (the whole library again, with its tests), and they run last.
tests=(slurm)
for f in tests/*.rs; do
  name=$(basename "$f" .rs)
  if [[ $name != slurm ]]; then tests+=("$name"); fi
done
# Each test target's executable, from cargo's messages: the tests run straight from it,
# so that cargo's lock on the build directory, held by the build beside them, is not
# waited for.
executables() {
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["profile"]["test"] and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])'
}
cargo build --release "${packages[@]}" --quiet --examples
cargo test --release "${packages[@]}" --no-run --quiet --bins "${tests[@]/#/--test=}" \
  --message-format=json-render-diagnostics | executables >"$targets"
# The MPICH build (its own target directory, a copy of this one), then the unit tests'
# build, at the lowest priority beside the tests: they take the CPU the tests leave idle
# (waits on Slurm's scheduler, time limits, timeouts). Their session is their own
# scheduling group where the kernel groups by session (autogroup): that group's nice is
# what ranks it against the tests' jobs, so it is set too. (At nice 0 a build beside the
# tests cost them more than it saved: ranks that yield the CPU while they wait gave it to
# the build.) The MPICH build, whose copy writes the whole target directory, comes first,
# beside the Slurm tests, as before the unit tests' build joined it.
setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null; out=$1; shift
  nice -n 19 bash scripts/mpich-check.sh build &&
  exec nice -n 19 cargo test --release "$@" --no-run --quiet --lib \
    --message-format=json-render-diagnostics >"$out"' _ "$targets.lib" "${packages[@]}" \
  >"$later_log" 2>&1 &
later_pid=$!
# One test thread: the mpirun tests must not run at once on 2 cores. A failure ends the
# script with the test's status (set -e, pipefail).
run_test() {
  echo "     Running $1 ($2)" | tee -a "$log"
  timeout 1500 "$2" --test-threads=1 2>&1 | tee -a "$log"
}
# Beside the builds: the Slurm tests (the builds fill their waits on Slurm's scheduler and
# time limits) and the quick tests without mpirun jobs that checkpoint. Every mpirun test
# waits until the builds are done: a build's writes can hold a checkpoint's fsync for a
# minute or more on these machines (the kernel's hung-task reports show it), and a
# training job waits on its chief's checkpoint
# (benches/results/2026-11-30-hybrid-rma-stalls.md).
beside_builds=(slurm cli_offline cli_scale compute engine fuzz)
test_of() {
  awk -v n="$1" '$1 == "test" && $2 == n {print $3}' "$targets"
}
beside() {
  [[ " ${beside_builds[*]} " == *" $1 "* ]]
}
for name in "${tests[@]}"; do
  if beside "$name"; then run_test "tests/$name.rs" "$(test_of "$name")"; fi
done
if ! wait "$later_pid"; then
  later_pid=
  echo "The unit tests' or the MPICH build failed:"; cat "$later_log"; exit 1
fi
later_pid=
for name in "${tests[@]}"; do
  if ! beside "$name"; then run_test "tests/$name.rs" "$(test_of "$name")"; fi
done
run_test "the binary's unit tests" "$(awk '$1 == "bin" {print $3}' "$targets")"
run_test "the library's unit tests" "$(executables <"$targets.lib" | awk '$1 == "lib" {print $3}')"
rm -f "$targets.lib"
timeout 1500 cargo test --release "${packages[@]}" --doc -- --test-threads=1 2>&1 | tee -a "$log"

phase "MPICH smoke run"
bash scripts/mpich-check.sh | tee -a "$log"

# One closing line over everything that ran.
passed=$(grep -Eo '([0-9]+) passed' "$log" | awk '{s += $1} END {print s + 0}')
failed=$(grep -Eo '([0-9]+) failed' "$log" | awk '{s += $1} END {print s + 0}')
phase done
echo "mpiflow: $passed passed, $failed failed in $SECONDS s ($(IFS=,; echo "${times[*]}" | sed 's/,/, /g'))"
