#!/usr/bin/env bash
# Installs the Debian packages Quilt builds against, when any is missing.
# Runs apt-get directly as root, through sudo otherwise. Idempotent and quiet when all is present.
set -euo pipefail
pkgs=(cmake ninja-build g++ make libopenmpi-dev openmpi-bin libeigen3-dev libcli11-dev doctest-dev
      libyaml-cpp-dev nlohmann-json3-dev libbenchmark-dev libopenblas-openmp-dev libblis-openmp-dev libdnnl-dev libxxhash-dev
      clang libclang-rt-14-dev libomp-14-dev fortunes ccache gnuplot-nox slurm-wlm munge)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "quilt: installing Debian packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then sudo=""; else sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
