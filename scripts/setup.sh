#!/usr/bin/env bash
# Installs what mpiflow needs on Debian 12 and is quiet when everything is already there.
# Idempotent: checks each package with dpkg-query before calling apt-get.
set -euo pipefail

PKGS=(openmpi-bin libopenmpi-dev libclang-dev clang pkg-config libhwloc-dev hwloc
      libopenblas-dev libudev-dev python3 iproute2 util-linux iputils-ping procps
      dataset-fashion-mnist ucx-utils)
# Slurm is only needed by the Slurm tests; install it when asked.
if [[ "${MPIFLOW_WITH_SLURM:-0}" == 1 ]]; then
  PKGS+=(slurmctld slurmd slurm-client munge)
fi
if [[ "${MPIFLOW_WITH_MPICH:-0}" == 1 ]]; then
  PKGS+=(mpich libmpich-dev)
fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "mpiflow setup: installing ${missing[*]}" >&2
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
    "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "mpiflow setup: cargo not found; install Rust (rustup) first" >&2
  exit 1
fi
