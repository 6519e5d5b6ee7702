#!/usr/bin/env bash
# Downloads (here, where the package registry is reachable) the Debian packages a GPU machine
# without them needs to build Quilt for tools/gpu-check, into .gpu-deps/ (ignored by git; about
# 3 MB). tools/gpu-check unpacks .gpu-deps/*.deb before building.
# Open MPI goes to .gpu-deps/mpi/ (18 MB): openmpi-bin, libopenmpi3, libopenmpi-dev (its
# headers only, not its dependencies, which pull in gfortran) and the libraries they load.
# `source tools/mpi-prefix.sh` unpacks them into a prefix of their own, never over the
# machine's libraries, and sets the variables that relocate Open MPI; gpu-check's build then
# has the MPI backend and `quilt`, and the multi-rank benches run there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu-deps
cd .gpu-deps
apt-get download libeigen3-dev doctest-dev libbenchmark-dev libbenchmark1debian nlohmann-json3-dev \
  libyaml-cpp-dev libyaml-cpp0.7 libcli11-dev libxxhash-dev libxxhash0
ls -1 *.deb
mkdir -p mpi
cd mpi
apt-get download openmpi-bin libopenmpi3 openmpi-common libopenmpi-dev libevent-core-2.1-7 \
  libevent-pthreads-2.1-7 libfabric1 libhwloc15 libibverbs1 ibverbs-providers libmunge2 libnl-3-200 \
  libnl-route-3-200 libnuma1 libpciaccess0 libpmix2 libpsm-infinipath1 libpsm2-2 librdmacm1 libucx0 \
  libxnvctrl0 ocl-icd-libopencl1 libxml2 libicu72 libx11-6 libxext6 libxcb1 libxau6 libxdmcp6 libbsd0 libmd0
ls -1 *.deb
