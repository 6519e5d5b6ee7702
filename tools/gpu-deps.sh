#!/usr/bin/env bash
# Downloads (here, where the package registry is reachable) the Debian packages a GPU machine
# without them needs to build Quilt for tools/gpu-check, into .gpu-deps/ (ignored by git; about
# 3 MB). tools/gpu-check unpacks .gpu-deps/*.deb before building. Open MPI is left out, so
# that build has no MPI backend (QUILT_MPI=OFF is automatic when MPI is absent) and runs the
# single-process and threads tests. (Its runtime closure is small — openmpi-bin, libopenmpi3
# and their 18 library packages are 6.3 MB of .deb — but unpacking Debian's MPI over another
# distribution's root is untried; libopenmpi-dev's own dependency closure pulls in gfortran.)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps
cd .gpu-deps
apt-get download libeigen3-dev doctest-dev libbenchmark-dev libbenchmark1debian nlohmann-json3-dev \
  libyaml-cpp-dev libyaml-cpp0.7 libcli11-dev libxxhash-dev libxxhash0
ls -1 *.deb
