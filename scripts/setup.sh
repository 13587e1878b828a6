#!/usr/bin/env bash
# Installs, only when missing, every Debian package that loom's build, tests
# and demo need. Safe to run again: it does nothing when all are present.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config python3
  libopenblas-dev libopenblas0-openmp libopenmpi-dev openmpi-bin
  nlohmann-json3-dev libcli11-dev libgtest-dev libbenchmark-dev
  fortunes
)
# LOOM_SETUP_BENCH=1 also installs what bench/ compares against.
if [[ "${LOOM_SETUP_BENCH:-0}" == 1 ]]; then
  packages+=(python3-torch python3-numpy)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: all packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
