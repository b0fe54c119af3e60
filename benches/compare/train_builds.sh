#!/usr/bin/env bash
# Two builds of mpiflow side by side on training throughput: samples/s of `mpiflow train`
# in each mode, jobs of the two binaries alternating.
#
#   cp target/release/mpiflow /tmp/mpiflow-before      # then change, cargo build --release
#   benches/compare/train_builds.sh /tmp/mpiflow-before target/release/mpiflow 5
#
# A job's rate: local mode, the samples/s of its closing line; the distributed modes, the
# median of the chief's logged windows' samples/s after the first (warm-up). The two
# binaries' jobs alternate, in the other order every second round. Prints, per
# mode and binary, the best job (the VM's slow phases only slow a job) and the spread
# (worst/best), and the after/before ratio of the bests. MODES picks modes by name (default
# all). Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ $# -lt 3 ]]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
before=$1 after=$2 jobs=$3
for bin in "$before" "$after"; do
  [[ -x $bin ]] || { echo "train_builds.sh: $bin is not an executable" >&2; exit 2; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
declare -A cmd=(
  [local]="BIN train --mode local --steps 20000 --log-every 2000"
  [allreduce]="mpirun --oversubscribe -np 4 BIN train --mode allreduce --steps 20000 --log-every 2000"
  [allreduce-cnn]="mpirun --oversubscribe -np 4 BIN train --mode allreduce --model cnn --data fashion-mnist --steps 400 --log-every 50"
  [ps-sync]="mpirun --oversubscribe -np 4 BIN train --mode ps --ps 1 --steps 10000 --log-every 1000"
  [ps-async]="mpirun --oversubscribe -np 4 BIN train --mode ps --ps 1 --async --steps 10000 --log-every 1000"
  [ps-cnn]="mpirun --oversubscribe -np 4 BIN train --mode ps --ps 1 --model cnn --data fashion-mnist --steps 300 --log-every 50"
  [rma-sync]="mpirun --oversubscribe -np 4 BIN train --mode ps --ps 1 --transport rma --steps 10000 --log-every 1000"
  [rma-async]="mpirun --oversubscribe -np 4 BIN train --mode ps --ps 1 --transport rma --async --optimizer sgd --lr 0.1 --steps 20000 --log-every 2000"
  [stages]="mpirun --oversubscribe -np 4 BIN train --mode allreduce --stages 2 --steps 4000 --log-every 400"
  [stages-cnn]="mpirun --oversubscribe -np 4 BIN train --mode allreduce --stages 2 --model cnn --data fashion-mnist --steps 300 --log-every 50"
  [stages-ps]="mpirun --oversubscribe -np 5 BIN train --mode ps --ps 1 --stages 2 --steps 3000 --log-every 300"
)
order=(local allreduce allreduce-cnn ps-sync ps-async ps-cnn rma-sync rma-async stages stages-cnn stages-ps)
# The job's rate, from its stdout.
rate() {
  awk '
    /^accuracy .* samples\/s$/ { print $(NF - 1); exit }
    /^step / { for (i = 1; i < NF; i++) if ($i == "samples/s" && ++n > 1) print $(i + 1) }
  ' | sort -g | awk '{ v[++n] = $1 } END { print (n ? v[int((n + 1) / 2)] : "nan") }'
}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for mode in ${MODES:-${order[*]}}; do
  for i in $(seq "$jobs"); do
    # The order alternates (before-after, then after-before), so that neither binary
    # always holds the same place in its pair (a place's effect on the rate:
    # benches/results/2026-11-29-ps-rings.md).
    sides=(before after)
    ((i % 2 == 0)) && sides=(after before)
    for side in "${sides[@]}"; do
      bin=$before
      [[ $side == after ]] && bin=$after
      # shellcheck disable=SC2086 # the command is a list of words
      timeout 600 ${cmd[$mode]//BIN/$bin} 2>/dev/null | rate >>"$out/$mode.$side"
    done
  done
  best() { sort -g "$out/$mode.$1" | tail -1; }
  worst() { sort -g "$out/$mode.$1" | head -1; }
  b=$(best before) a=$(best after)
  printf '%-14s before %8.0f (worst/best %.2f)  after %8.0f (worst/best %.2f)  after/before %.3f\n' \
    "$mode" "$b" "$(echo "$(worst before) / $b" | bc -l)" "$a" "$(echo "$(worst after) / $a" | bc -l)" \
    "$(echo "$a / $b" | bc -l)"
done
