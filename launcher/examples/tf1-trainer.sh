#!/usr/bin/env bash
# The seeds' TensorFlow 1 trainer (tf1_trainer.py: ps tasks that server.join() forever,
# workers under a MonitoredTrainingSession) as an MPI job through `mpiflow launch`: it ends
# when the workers are done. Real TensorFlow, in a virtual environment outside the repo.
#
#   launcher/examples/tf1-trainer.sh --install   # creates $MPIFLOW_TF_VENV with tensorflow-cpu
#   NP=4 PS=1 STEPS=200 launcher/examples/tf1-trainer.sh
#   launcher/examples/tf1-trainer.sh --ps-lifetime forever   # TensorFlow's own behaviour
#
# Extra arguments go to `mpiflow launch`. Prints the job's output, exit status and wall time.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${MPIFLOW_TF_VENV:-../venv-tf}
NP=${NP:-3}
PS=${PS:-1}
STEPS=${STEPS:-200}
if [[ "${1:-}" == "--install" ]]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q tensorflow-cpu
  shift
fi
if ! "$VENV/bin/python" -c "import tensorflow" 2>/dev/null; then
  echo "no tensorflow in $VENV: run $0 --install (or set MPIFLOW_TF_VENV)" >&2
  exit 1
fi
source scripts/env.sh
cargo build --release --quiet --bin mpiflow
if [[ $VENV == /* ]]; then export PATH="$VENV/bin:$PATH"; else export PATH="$PWD/$VENV/bin:$PATH"; fi
export TF_CPP_MIN_LOG_LEVEL=2
ckpt=$(mktemp -d)
trap 'rm -rf "$ckpt"' EXIT
start=$(date +%s%N)
set +e
timeout 600 mpirun -np "$NP" target/release/mpiflow launch --ps "$PS" --legacy-flags "$@" \
  -- python3 launcher/examples/tf1_trainer.py --steps "$STEPS" --checkpoint_dir "$ckpt"
status=$?
set -e
ms=$((($(date +%s%N) - start) / 1000000))
printf '# exit status %d after %d.%03d s\n' "$status" $((ms / 1000)) $((ms % 1000))
exit "$status"
