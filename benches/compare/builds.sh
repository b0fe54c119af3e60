#!/usr/bin/env bash
# Two builds of mpiflow side by side: is a change to the runtime faster than the build
# before it?
#
#   cp target/release/mpiflow /tmp/mpiflow-before      # then change, cargo build --release
#   benches/compare/builds.sh /tmp/mpiflow-before target/release/mpiflow 80 \
#       latency -m 1:64 --rounds 3
#
# Runs JOBS jobs of each binary, alternating (`mpirun -np $NP BIN bench ARGS --rotate i`:
# job i starts the paths' rotation i places on), and prints, per binary, each `# ratio`
# line's median over the jobs with its quartiles (a job's ratio is the median over its
# rounds of one path against the `mpi` path measured in the same round). On a machine
# whose whole jobs run in slow and fast phases, the in-job ratio is what holds still, and
# the `mpi` path, the same code in both builds, is each job's yardstick. Not part of the
# tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ $# -lt 4 ]]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
before=$1 after=$2 jobs=$3
shift 3
NP=${NP:-2}
for bin in "$before" "$after"; do
  [[ -x $bin ]] || { echo "builds.sh: $bin is not an executable" >&2; exit 2; }
done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# `# ratio mpiflow/mpi (...)` then `# SIZE RATIO` lines -> `mpiflow/mpi SIZE RATIO`.
ratios() {
  awk '/^# ratio /{ r = $3; next } r != "" && $1 == "#" && $2 ~ /^[0-9]+$/ { print r, $2, $3 }'
}
for i in $(seq "$jobs"); do
  for side in before after; do
    bin=$before
    [[ $side == after ]] && bin=$after
    # shellcheck disable=SC2086 # MPIRUN_ARGS is a list of options
    timeout 600 mpirun ${MPIRUN_ARGS:-} -np "$NP" "$bin" bench "$@" --rotate "$i" | ratios >>"$out/$side"
  done
done
for side in before after; do
  bin=$before
  [[ $side == after ]] && bin=$after
  echo "# $side: $bin, $jobs jobs of bench $*: median (first quartile, third quartile)"
  sort -k1,1 -k2,2n -k3,3g "$out/$side" | awk '
    { k = $1 " " $2; v[k, ++n[k]] = $3; if (!(k in seen)) { seen[k] = 1; order[++m] = k } }
    END {
      for (i = 1; i <= m; i++) {
        k = order[i]; c = n[k]
        printf "%-22s %.3f (%.3f, %.3f)\n", k, v[k, int(c / 2) + 1], v[k, int(c / 4) + 1], v[k, int(3 * c / 4) + 1]
      }
    }'
done
