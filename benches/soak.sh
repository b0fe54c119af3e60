#!/usr/bin/env bash
# Soak test (not part of CI): trains for about DURATION seconds under `mpiflow supervise`
# while a random rank of the job is SIGKILLed every 20-60 s, then checks that training
# reached its final step, that the final checkpoint loads, and the accuracy target.
# Prints the kills, restarts and steps lost.
#
#   benches/soak.sh [allreduce|ps|rma] [DURATION] [RANKS]     default: allreduce 600 s, 3 ranks
#
# The step count is sized from a short calibration run so that training without kills
# would take about 80% of DURATION. Needs a release build (cargo build --release).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-allreduce}
DURATION=${2:-600}
RANKS=${3:-3}
MPIFLOW=$PWD/target/release/mpiflow
[[ -x $MPIFLOW ]] || { echo "soak: build first: cargo build --release" >&2; exit 2; }
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
case $MODE in
  allreduce) FLAGS=(--mode allreduce) ;;
  ps) FLAGS=(--mode ps --ps 1) ;;
  rma) FLAGS=(--mode ps --ps 1 --transport rma) ;;
  *) echo "soak: mode is allreduce, ps or rma, not '$MODE'" >&2; exit 2 ;;
esac
WORK=$(mktemp -d /tmp/mpiflow-soak-XXXXXX)
CKPT=$WORK/ckpt
JOB=(mpirun --oversubscribe -np "$RANKS" "$MPIFLOW" train "${FLAGS[@]}")

# Calibration: steps per second of this mode here, from a 20000-step run's log.
rate=$(timeout 120 "${JOB[@]}" --steps 20000 --log-every 10000 2>/dev/null |
  awk '/^step +20000 /{for (i = 1; i < NF; i++) if ($i == "steps/s") print int($(i + 1))}')
[[ -n $rate && $rate -gt 0 ]] || { echo "soak: calibration run failed" >&2; exit 1; }
STEPS=$((rate * DURATION * 8 / 10))
EVERY=$((rate * 2))           # a checkpoint about every 2 s
LOG=$((rate / 2))             # a log line about every 0.5 s (supervise counts lost steps by it)
echo "# soak: $MODE, $RANKS ranks, $rate steps/s calibrated, $STEPS steps, checkpoint every $EVERY, $DURATION s"

start=$SECONDS
"$MPIFLOW" supervise --max-restarts 1000 --checkpoint-dir "$CKPT" -- \
  "${JOB[@]}" --steps "$STEPS" --checkpoint-every "$EVERY" --log-every "$LOG" \
  --checkpoint-dir "$CKPT" >"$WORK/out" 2>&1 &
SUP=$!

kills=0
while kill -0 "$SUP" 2>/dev/null; do
  sleep $((20 + RANDOM % 41))
  # The ranks of this job (not mpirun): its own checkpoint directory names them.
  mapfile -t ranks < <(pgrep -f "^$MPIFLOW train .*--checkpoint-dir $CKPT" || true)
  ((${#ranks[@]})) || continue
  victim=${ranks[RANDOM % ${#ranks[@]}]}
  if kill -KILL "$victim" 2>/dev/null; then
    kills=$((kills + 1))
    echo "# $((SECONDS - start)) s: killed pid $victim"
  fi
done
status=0
wait "$SUP" || status=$?
took=$((SECONDS - start))

restarts=$(grep -c '^mpiflow supervise: .*restart [0-9]* of' "$WORK/out" || true)
lost=$(grep -o ', [0-9]* steps lost' "$WORK/out" | awk '{s += $2} END {print s + 0}')
newest=$(ls "$CKPT" | sed -n 's/^ckpt-\([0-9]*\)$/\1/p' | sort -n | tail -1)
acc=$(awk '/^accuracy /{print $2}' "$WORK/out" | tail -1)
# The final checkpoint loads: a rerun restores it and has nothing left to train.
reload=$(timeout 120 "${JOB[@]}" --steps "$STEPS" --log-every 0 --checkpoint-dir "$CKPT" 2>&1 |
  grep -c "restored $CKPT/ckpt-$STEPS (global step $STEPS)" || true)

echo "mode $MODE: $took s, exit $status, kills $kills, restarts $restarts, steps lost $lost (by the last logged step), final checkpoint step ${newest:-none} of $STEPS, reloads $reload, accuracy ${acc:-none}"
ok=1
[[ $status -eq 0 ]] || ok=0
[[ ${newest:-0} -eq $STEPS ]] || ok=0
[[ $reload -ge 1 ]] || ok=0
awk -v a="${acc:-0}" 'BEGIN {exit !(a >= 0.95)}' || ok=0
if ((ok)); then
  echo "soak: passed ($WORK/out)"
else
  echo "soak: FAILED; the supervised job's output: $WORK/out" >&2
  exit 1
fi
