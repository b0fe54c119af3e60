#!/usr/bin/env bash
# mpiflow's benchmarks beside the OSU Micro-Benchmarks 7.4 themselves, in alternating jobs.
#
#   benches/compare/osu.sh                       # latency bw bibw allreduce bcast, one-sided
#   ROUNDS=6 NP=2 benches/compare/osu.sh latency bw
#   OSU_ARGS="-b multiple" benches/compare/osu.sh bw bibw   # options given to both
#   MPIFLOW_RDMA_STACK=ucx benches/compare/osu.sh put_latency acc_latency   # both on UCX
#   NP=4 OSU_ARGS="-m 1048576:16777216" benches/compare/osu.sh pushpull   # ps beside plain MPI
#   MPI=mpich benches/compare/osu.sh latency bw   # both built for and run by MPICH (Hydra)
#   tests/netns/cluster.sh with -- env MPIRUN_ARGS='$MPIFLOW_NETNS_MCA --hostfile
#     hostfiles/netns-3hosts --map-by node --bind-to none' benches/compare/osu.sh latency
#                                                # across the namespace hosts
#
# Builds OSU 7.4 from ../shared/tools/osu-7.4 (or $OSU_SRC) into target/osu-7.4 once
# (printing DIGITS digits, see below), then for each benchmark runs ROUNDS rounds of two
# jobs: OSU's program, then `mpiflow bench` with all its paths (mpi, mpiflow, and channel
# and inbox for latency, bw, bibw). This machine's noise only ever slows a run, so each
# program's best round per size estimates its cost; the table prints those bests side by
# side, the ratios to OSU's best (>1 is slower for latencies, faster for bandwidths), and
# each column's spread over rounds (worst/best).
# Where whole jobs run in slow and fast phases (an AMD VM: 2-4x apart below 4 KiB), bests of
# separate jobs can still differ by tens of percent from run to run; the `~` columns hold
# what does not: mpiflow's paths against its `mpi` path measured in the same job, round by
# round (the ratio lines of `mpiflow bench`), the median over the ROUNDS jobs; job r starts
# its rotation of paths r places on (`--rotate`), so each path goes first in as many jobs as
# the others (a path's place in the order was worth 1-2%).
# Bests across jobs favour the shorter job when fast phases come and go within seconds:
# OSU's job runs one path, mpiflow's all of them. ALONE="mpi mpiflow" adds, each round, a
# job per path named that runs that path alone (a job as long as OSU's); its columns are
# headed "PATH1" and "PATH1/osu", so the bests of jobs of one length can be compared.
# The `:r` columns compare with OSU's program across jobs without trusting whole jobs'
# phases: a path's value over OSU's in the same round (jobs run one after the other,
# seconds apart, which phases lasting tens of seconds mostly share), the median over the
# rounds.
# `pushpull` has no OSU program: its jobs are mpiflow's alone and its reference column is
# the plain-MPI pattern (`mpi`). Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-6}
NP=${NP:-2}
OSU_SRC=${OSU_SRC:-../shared/tools/osu-7.4}
# The MPI both programs are built for and run by: Open MPI (Debian's default `mpicc` and
# `mpirun`) or MPICH (`mpicc.mpich`, `mpiexec.mpich`, mpiflow built by
# scripts/mpich-check.sh into target/mpich).
MPI=${MPI:-openmpi}
case $MPI in
  openmpi) suffix='' launcher=mpirun mpiflow=target/release/mpiflow ;;
  mpich)
    suffix=-mpich launcher=mpiexec.mpich mpiflow=${MPIFLOW_MPICH_TARGET:-target/mpich}/release/mpiflow
    export MPICC=${MPICC:-mpicc.mpich} ;;
  *) echo "MPI=$MPI: openmpi or mpich" >&2; exit 2 ;;
esac
# A directory given is used as it is (an OSU built elsewhere), target/osu-7.4 is built here.
osu_given=${OSU_DIR:+yes}
OSU_DIR=${OSU_DIR:-target/osu-7.4$suffix}
OSU_ARGS=${OSU_ARGS:-}
ALONE=${ALONE:-}
# Digits after the point in both programs' tables: OSU prints 2 (its compile-time
# FLOAT_PRECISION, which rounds a 0.2 us latency to 5%), so its build here sets 4, the
# source unchanged, and `mpiflow bench` gets `--digits` to match.
DIGITS=${DIGITS:-4}
# Options for mpirun (hosts, mapping); `$VARIABLES` in them are expanded here.
MPIRUN_ARGS=$(eval echo "${MPIRUN_ARGS:-}")
names=("$@")
if [[ ${#names[@]} -eq 0 ]]; then
  names=(latency bw bibw allreduce bcast put_latency get_latency acc_latency get_bw)
fi
source scripts/env.sh
# The components mpiflow chooses (src/transport/stack.rs; MPIFLOW_RDMA_STACK=auto|ucx|ompi),
# for OSU too: the same MPI settings on both sides.
rdma=$(ls /sys/class/infiniband 2>/dev/null || true)
case ${MPIFLOW_RDMA_STACK:-auto} in
  ucx)
    export OMPI_MCA_pml=ucx OMPI_MCA_osc=ucx
    if [[ -z $rdma ]]; then export OMPI_MCA_pml_ucx_tls=any OMPI_MCA_pml_ucx_devices=any; fi ;;
  ompi) export OMPI_MCA_pml=ob1 OMPI_MCA_osc=sm,pt2pt ;;
  *) if [[ -z $rdma ]]; then export OMPI_MCA_osc=${OMPI_MCA_osc:-sm,pt2pt}; fi ;;
esac
if [[ $MPI == mpich ]]; then
  bash scripts/mpich-check.sh build
else
  cargo build --release --quiet --bin mpiflow
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# OSU's build script takes the compiler from $MPICC: a wrapper adds the precision.
if [[ ! -x $OSU_DIR/osu_latency ]] ||
  [[ -z $osu_given && $(cat "$OSU_DIR/DIGITS" 2>/dev/null) != "$DIGITS" ]]; then
  printf '#!/bin/sh\nexec %s -DFLOAT_PRECISION=%s "$@"\n' "${MPICC:-mpicc}" "$DIGITS" >"$out/mpicc"
  chmod +x "$out/mpicc"
  MPICC=$out/mpicc bash "$OSU_SRC/build.sh" "$OSU_DIR" >/dev/null
  echo "$DIGITS" >"$OSU_DIR/DIGITS"
fi
# The rows of every table in a run's output, as `path size value` (OSU's own output has no
# `# mpiflow path:` line: its path is `osu`), and the rows of mpiflow's ratio lines (two
# paths measured in the same job, `# ratio mpiflow/mpi ...`) as `paired:mpiflow/mpi size
# ratio`.
rows() {
  awk -v first="$1" '
    /^# mpiflow path:/ { sub(/^# mpiflow path: /, ""); path = $0; gsub(/ /, "_", path); ratio = ""; next }
    /^# ratio / { ratio = $0; sub(/^# ratio /, "", ratio); sub(/ \(median.*$/, "", ratio); gsub(/ /, "_", ratio); next }
    ratio != "" && $1 == "#" && $2 ~ /^[0-9]+$/ { print "paired:" ratio, $2, $3; next }
    /^#/ || NF < 2 { next }
    $1 ~ /^[0-9]+$/ { print (path == "" ? first : path), $1, $2 }'
}
for name in "${names[@]}"; do
  case $name in
    latency | bw | bibw) better=lower ref=osu; [[ $name != latency ]] && better=higher ;;
    allreduce | bcast | put_latency | get_latency | acc_latency) better=lower ref=osu ;;
    get_bw) better=higher ref=osu ;;
    pushpull) better=higher ref=mpi ;;
    *) echo "unknown benchmark $name" >&2; exit 2 ;;
  esac
  : >"$out/$name"
  for r in $(seq "$ROUNDS"); do
    if [[ $ref == osu ]]; then
      # shellcheck disable=SC2086 # OSU_ARGS is a list of options
      timeout 900 $launcher $MPIRUN_ARGS -np "$NP" "$OSU_DIR/osu_$name" $OSU_ARGS | rows osu | sed "s/^/$r /" >>"$out/$name"
    fi
    # shellcheck disable=SC2086
    timeout 900 $launcher $MPIRUN_ARGS -np "$NP" "$mpiflow" bench "$name" --rounds 1 --rotate "$r" --digits "$DIGITS" $OSU_ARGS \
      | rows mpiflow | sed "s/^/$r /" >>"$out/$name"
    for path in $ALONE; do
      # shellcheck disable=SC2086
      timeout 900 $launcher $MPIRUN_ARGS -np "$NP" "$mpiflow" bench "$name" --path "$path" --rounds 1 --digits "$DIGITS" $OSU_ARGS \
        | sed 's/^# mpiflow path: .*/& alone/' | rows mpiflow | sed "s/^/$r /" >>"$out/$name"
    done
  done
  echo "# $name: $NP ranks, $MPI, best of $ROUNDS alternating jobs per program ($better is better)${OSU_ARGS:+, options $OSU_ARGS}${MPIRUN_ARGS:+, mpirun $MPIRUN_ARGS}"
  echo "# a/b~: median over the jobs of a/b measured in the same job; a/b:r: median over the rounds of a's job over b's (see the head of this script)"
  awk -v better="$better" -v ref="$ref" -v digits="$DIGITS" '
    BEGIN { np = 1; paths[1] = ref; seen[ref] = 1 }
    # The name of a path in at most w characters; one run alone ("mpi_alone") ends in "1".
    function abbrev(s, w,    alone) {
      alone = sub(/_alone$/, "", s)
      return alone ? substr(s, 1, w - 1) "1" : substr(s, 1, w)
    }
    # The median of v[1..n] (the upper middle one of an even count), by insertion sort.
    function median(n,    x1, x2, t) {
      for (x1 = 2; x1 <= n; x1++) for (x2 = x1; x2 > 1 && v[x2 - 1] > v[x2]; x2--) { t = v[x2]; v[x2] = v[x2 - 1]; v[x2 - 1] = t }
      return v[int(n / 2) + 1]
    }
    # Rows are "round path size value". In-job ratios of every job, per pair of paths and
    # size; the median is printed.
    $2 ~ /^paired:/ {
      k = substr($2, 8)
      if (!(k in pseen)) { pseen[k] = 1; pairs[++npairs] = k }
      pv[k, $3, ++pn[k, $3]] = $4
      next
    }
    {
      $0 = $2 " " $3 " " $4 " " $1
      key = $1 SUBSEP $2
      at[$1, $2, $4] = $3
      if (!($4 in rseen)) { rseen[$4] = 1; rounds[++nr] = $4 }
      if (!(key in best)) { best[key] = $3; worst[key] = $3 }
      if ((better == "lower") == ($3 < best[key])) best[key] = $3
      if ((better == "lower") == ($3 > worst[key])) worst[key] = $3
      if (!($1 in seen)) { seen[$1] = 1; paths[++np] = $1 }
      if (!($2 in sizes)) { sizes[$2] = 1; order[++ns] = $2 }
    }
    END {
      printf "%-9s", "# size"
      for (p = 1; p <= np; p++) printf " %14s", abbrev(paths[p], 14)
      for (p = 2; p <= np; p++) printf " %12s", abbrev(paths[p], 8) "/" ref
      for (q = 1; q <= npairs; q++) printf " %14s", substr(pairs[q], 1, 13) "~"
      for (p = 2; p <= np; p++) printf " %12s", abbrev(paths[p], 6) "/" ref ":r"
      printf "   spread (worst/best):"
      for (p = 1; p <= np; p++) printf " %s", paths[p]
      printf "\n"
      for (i = 1; i <= ns; i++) {
        s = order[i]; o = best[ref SUBSEP s]
        # A program that has no row at a size (mpiflow starts allreduce at one float)
        # shows "-".
        printf "%-9s", s
        for (p = 1; p <= np; p++) {
          k = paths[p] SUBSEP s
          if (k in best) printf " %14." digits "f", best[k]; else printf " %14s", "-"
        }
        for (p = 2; p <= np; p++) {
          k = paths[p] SUBSEP s
          if ((k in best) && o > 0) printf " %12.3f", best[k] / o; else printf " %12s", "-"
        }
        for (q = 1; q <= npairs; q++) {
          n = pn[pairs[q], s]
          if (n == 0) { printf " %14s", "-"; continue }
          for (x1 = 1; x1 <= n; x1++) v[x1] = pv[pairs[q], s, x1]
          printf " %14.3f", median(n)
        }
        # Each path against the job of the reference in the same round.
        for (p = 2; p <= np; p++) {
          n = 0
          for (x1 = 1; x1 <= nr; x1++) {
            r = rounds[x1]
            if (((paths[p], s, r) in at) && ((ref, s, r) in at) && at[ref, s, r] > 0) v[++n] = at[paths[p], s, r] / at[ref, s, r]
          }
          if (n == 0) printf " %12s", "-"; else printf " %12.3f", median(n)
        }
        printf "   "
        for (p = 1; p <= np; p++) {
          k = paths[p] SUBSEP s
          b = best[k]; w = worst[k]
          if (!(k in best) || b <= 0 || w <= 0) printf " -"
          else printf " %.2f", (better == "lower" ? w / b : b / w)
        }
        printf "\n"
      }
    }' "$out/$name"
  echo
done
