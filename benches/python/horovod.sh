#!/usr/bin/env bash
# Installs Horovod (PyTorch, MPI operations, no Gloo/TensorFlow/MXNet) into the PyTorch
# environment benches/python/torch-venv.sh makes, outside the repository, for the third
# column of benches/python/torch_ddp.py. Prints the environment's python.
#
# Horovod's newest release (0.28.1) compiles its PyTorch extension as C++14 (its
# CMakeLists set CMAKE_CXX_STANDARD 14), which current PyTorch's headers refuse ("C++20 or
# later compatible compiler is required"), so `pip install horovod` fails here. This
# script builds the same release from its source distribution with that one setting
# raised to 20; nothing else of Horovod is changed. Takes about 15 minutes on 2 cores.
#
#   bash benches/python/horovod.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
python=$(bash benches/python/torch-venv.sh | tail -1)
bin=$(dirname "$python")
if "$python" -c 'import horovod.torch' 2>/dev/null; then
  echo "$python"
  exit 0
fi
version=0.28.1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip=(-m pip --disable-pip-version-check)
"$python" "${pip[@]}" install --quiet cmake wheel packaging pyyaml psutil cloudpickle >&2
"$python" "${pip[@]}" download --quiet --no-deps --no-binary :all: -d "$work" "horovod==$version" >&2
tar -xzf "$work/horovod-$version.tar.gz" -C "$work"
src=$work/horovod-$version
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 20)/' \
  "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
echo "horovod: building $version (PyTorch, MPI) into $(dirname "$bin")" >&2
HOROVOD_CMAKE=$bin/cmake HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=MPI \
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 \
  MAKEFLAGS=-j"$(nproc)" PATH="$bin:$PATH" \
  "$python" "${pip[@]}" install --quiet --no-build-isolation "$src" >&2
"$python" -c 'import horovod.torch' >&2
echo "$python"
