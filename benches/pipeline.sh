#!/usr/bin/env bash
# Pipeline training (`train --stages`) on this machine: samples/s over stages S, replicas
# R and micro-batches M, by both schedules, beside data-parallel allreduce and one process
# on the same model and batch; the measured bubble against GPipe's (S-1)/(M+S-1); the
# peak activation memory of stage 0 under 1F1B against GPipe.
#
#   benches/pipeline.sh                     # 3 rounds, the table on stdout
#   ROUNDS=5 STEPS=100 benches/pipeline.sh
#
# Every configuration runs once per round, rounds interleaved (the VM's slow phases hit
# every configuration alike); the table keeps each one's best round (samples/s of the
# whole run, from the log line of its last step) and the spread (worst/best). Runs with
# more ranks than cores (S x R > 2 here) share them: their samples/s show the pipeline's
# overheads, not its speed-up. Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-60}
BATCH=${BATCH:-256}
HIDDEN=${HIDDEN:-1024,1024,1024}
OUT=${OUT:-target/pipeline}
source scripts/env.sh
cargo build --release -q
B=target/release/mpiflow
mkdir -p "$OUT"
rm -f "$OUT"/*.log

# NAME MODEL NP then train's flags. The "even" runs train the MLP on the 64-feature
# digits, whose layers split into two stages of equal time (the bubble then shows alone);
# on Fashion-MNIST's 784 features the first stage is heavier.
CONFIGS=(
  "even-S2-M1-gpipe mlp 2 --mode allreduce --stages 2 --micro-batches 1 --schedule gpipe --data digits"
  "even-S2-M4-gpipe mlp 2 --mode allreduce --stages 2 --micro-batches 4 --schedule gpipe --data digits"
  "even-S2-M8-gpipe mlp 2 --mode allreduce --stages 2 --micro-batches 8 --schedule gpipe --data digits"
  "even-S2-M4-1f1b mlp 2 --mode allreduce --stages 2 --micro-batches 4 --schedule 1f1b --data digits"
  "even-S2-M8-1f1b mlp 2 --mode allreduce --stages 2 --micro-batches 8 --schedule 1f1b --data digits"
  "local mlp 1 --mode local"
  "allreduce-R2 mlp 2 --mode allreduce"
  "S2-R1-M1-gpipe mlp 2 --mode allreduce --stages 2 --micro-batches 1 --schedule gpipe"
  "S2-R1-M2-gpipe mlp 2 --mode allreduce --stages 2 --micro-batches 2 --schedule gpipe"
  "S2-R1-M4-gpipe mlp 2 --mode allreduce --stages 2 --micro-batches 4 --schedule gpipe"
  "S2-R1-M8-gpipe mlp 2 --mode allreduce --stages 2 --micro-batches 8 --schedule gpipe"
  "S2-R1-M2-1f1b mlp 2 --mode allreduce --stages 2 --micro-batches 2 --schedule 1f1b"
  "S2-R1-M4-1f1b mlp 2 --mode allreduce --stages 2 --micro-batches 4 --schedule 1f1b"
  "S2-R1-M8-1f1b mlp 2 --mode allreduce --stages 2 --micro-batches 8 --schedule 1f1b"
  "S2-R1-M16-1f1b mlp 2 --mode allreduce --stages 2 --micro-batches 16 --schedule 1f1b"
  "S2-R2-M4-1f1b mlp 4 --mode allreduce --stages 2 --micro-batches 4 --schedule 1f1b"
  "S3-R1-M6-1f1b mlp 3 --mode allreduce --stages 3 --micro-batches 6 --schedule 1f1b"
  "S4-R1-M8-gpipe mlp 4 --mode allreduce --stages 4 --micro-batches 8 --schedule gpipe"
  "S4-R1-M8-1f1b mlp 4 --mode allreduce --stages 4 --micro-batches 8 --schedule 1f1b"
  "ps-S2-R1-M4-1f1b mlp 3 --mode ps --ps 1 --stages 2 --micro-batches 4 --schedule 1f1b"
  "cnn-local cnn 1 --mode local"
  "cnn-allreduce-R2 cnn 2 --mode allreduce"
  "cnn-S2-R1-M4-1f1b cnn 2 --mode allreduce --stages 2 --micro-batches 4 --schedule 1f1b"
  "cnn-S2-R2-M4-1f1b cnn 4 --mode allreduce --stages 2 --micro-batches 4 --schedule 1f1b"
  "cnn-ps-S2-R2-M4-1f1b cnn 5 --mode ps --ps 1 --stages 2 --micro-batches 4 --schedule 1f1b"
)

for r in $(seq "$ROUNDS"); do
  for c in "${CONFIGS[@]}"; do
    read -r name model np flags <<< "$c"
    data="--data fashion-mnist"
    [[ $flags == *--data* ]] && data=""
    extra="$data --steps $STEPS --log-every $STEPS --batch $BATCH --progress lines"
    [[ $model == mlp ]] && extra="$extra --hidden $HIDDEN"
    echo "# round $r: $name" >&2
    if [[ $np == 1 ]]; then
      timeout 600 "$B" train --model "$model" $flags $extra --blas-threads 2 \
        > "$OUT/$name-r$r.log" 2>&1
    else
      timeout 600 mpirun --oversubscribe --bind-to none -np "$np" "$B" train \
        --model "$model" $flags $extra --blas-threads 1 --check-every 0 \
        > "$OUT/$name-r$r.log" 2>&1
    fi
  done
done

echo "| configuration | ranks | samples/s (best of $ROUNDS) | spread | bubble measured | (S-1)/(M+S-1) | stage 0 peak activations |"
echo "|---|---|---|---|---|---|---|"
for c in "${CONFIGS[@]}"; do
  read -r name model np flags <<< "$c"
  rates=$(grep -h "^step " "$OUT/$name"-r*.log | sed 's/.*samples\/s \([0-9.]*\).*/\1/' | sort -g)
  best=$(tail -1 <<< "$rates")
  worst=$(head -1 <<< "$rates")
  spread=$(awk -v b="$best" -v w="$worst" 'BEGIN { printf "%.2f", w / b }')
  best_log=$(grep -l "samples/s $best" "$OUT/$name"-r*.log | head -1)
  bubble=$(grep -h "^# bubble: " "$best_log" | sed 's/# bubble: \([0-9.]*%\).*GPipe.s (S-1)\/(M+S-1) = \([0-9.]*%\).*/\1 \2/' || true)
  peak=$(grep -h "^# memory per task: " "$best_log" | sed 's/.*stage 0: [^;]*peak activations \([0-9]*\) B.*/\1/' || true)
  measured=${bubble% *}
  formula=${bubble#* }
  [[ -z $bubble ]] && measured="-" && formula="-"
  [[ -z $peak ]] && peak="-"
  echo "| $name | $np | $best | $spread | $measured | $formula | $peak |"
done
