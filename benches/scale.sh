#!/usr/bin/env bash
# The scale model (`mpiflow scale`) fitted to this machine's links and checked against
# training runs across the namespace hosts of tests/netns/cluster.sh.
#
#   benches/scale.sh                       # a 10 Gbit/s network, 2 rounds
#   RATE=1gbit STEPS=150 LOG_EVERY=25 benches/scale.sh   # another link speed (tc's units)
#
# 1. The shared-memory link: `mpiflow bench latency` between two ranks of this machine.
# 2. In the cluster, each host's port shaped to RATE: the network link (the same across two
#    hosts, one way, and `bench bibw -W 1`: a message each way at once); then ROUNDS
#    rounds of training runs with --metrics, each a few hundred steps of BATCH samples
#    per worker: the MLP (HIDDEN) and the CNN on Fashion-MNIST, by
#    allreduce on 2 and 3 hosts of one worker and 2 hosts of two, by the synchronous ps
#    (one ps task on its own host) with 1 and 2 workers on 2 and 3 hosts.
# 3. `mpiflow scale`: the links fitted, the models measured here, the weak-scaling table
#    from 2 to 1024 hosts, every run beside its prediction, and an SVG.
# Everything lands in OUT (target/scale/RATE); MEASURE=0 redoes step 3 alone on what is
# there. Needs root (network namespaces). Not part of the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-10gbit}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-300}
LOG_EVERY=${LOG_EVERY:-50}
BATCH=${BATCH:-64}
HIDDEN=${HIDDEN:-1024,1024}
OUT=${OUT:-target/scale/$RATE}
source scripts/env.sh
cargo build --release -q
B=target/release/mpiflow
mkdir -p "$OUT"
if [[ ${MEASURE:-1} == 1 ]]; then
rm -f "$OUT"/*.jsonl

echo "# shared memory: mpiflow bench latency, 2 ranks on this machine" >&2
timeout 300 mpirun -np 2 "$B" bench latency --path mpiflow -m 1:4194304 --rounds 3 \
  --progress lines > "$OUT/shm.txt"

# The runs, inside the cluster: MODE MODEL HOSTS(--host) NP WORKERS NAME.
cat > "$OUT/inside.sh" <<EOF
set -euo pipefail
run() {
  local mode=\$1 model=\$2 hosts=\$3 np=\$4 workers=\$5 file=\$6 extra=""
  [[ \$mode == ps ]] && extra="--ps 1 --sync"
  [[ \$model == mlp ]] && extra="\$extra --hidden $HIDDEN"
  echo "# \$file: \$mode, \$model, --host \$hosts -np \$np" >&2
  timeout 600 mpirun \$MPIFLOW_NETNS_MCA --host \$hosts --map-by node -np \$np $B train \\
    --mode \$mode --model \$model \$extra --data fashion-mnist --steps $STEPS --log-every $LOG_EVERY \\
    --batch \$(( $BATCH * workers )) --check-every 0 --progress lines \\
    --metrics "$OUT/\$file.jsonl" > "$OUT/\$file.log" 2>&1
}
echo "# network: mpiflow bench latency across two hosts" >&2
timeout 300 mpirun \$MPIFLOW_NETNS_MCA --host h1,h2 --map-by node -np 2 $B bench latency \\
  --path mpiflow -m 1:4194304 --rounds 3 --progress lines > "$OUT/net.txt"
timeout 300 mpirun \$MPIFLOW_NETNS_MCA --host h1,h2 --map-by node -np 2 $B bench bibw -W 1 \\
  --path mpiflow -m 1:4194304 --rounds 3 --progress lines > "$OUT/net-bibw.txt"
for r in \$(seq $ROUNDS); do
  for model in mlp cnn; do
    run allreduce \$model h1,h2 2 2 \$model-allreduce-2-r\$r
    run ps \$model h1,h2 2 1 \$model-ps-2-r\$r
    run allreduce \$model h1,h2,h3 3 3 \$model-allreduce-3-r\$r
    run ps \$model h1,h2,h3 3 2 \$model-ps-3-r\$r
    run allreduce \$model h1:2,h2:2 4 4 \$model-allreduce-2x2-r\$r
  done
done
EOF
MPIFLOW_NETNS_RATE=$RATE timeout 3600 tests/netns/cluster.sh with -- bash "$OUT/inside.sh"
fi

runs=()
for f in "$OUT"/*.jsonl; do
  base=$(basename "$f" .jsonl)           # MODEL-MODE-HOSTS[xN]-rR
  IFS=- read -r model _ hosts _ <<< "$base"
  runs+=(--run "$model:${hosts%%x*}:$f")
done
"$B" scale --shm "$OUT/shm.txt" --net "$OUT/net.txt" --net-bibw "$OUT/net-bibw.txt" \
  --model mlp,cnn --hidden "$HIDDEN" --batch "$BATCH" "${runs[@]}" --svg "$OUT/scale.svg" | tee "$OUT/scale.txt"
