# Source this on a machine without MPI (the GPU machine): unpacks Debian's Open MPI and the
# libraries it needs from .gpu-deps/mpi/*.deb (tools/gpu-deps.sh fetches them) into a prefix
# of its own, never over the system's libraries, and points PATH, LD_LIBRARY_PATH and Open
# MPI's relocation variables at it, so that CMake finds mpicxx and the benches' mpiexec runs.
#
#   source tools/mpi-prefix.sh [PREFIX] [--force]   # PREFIX defaults to /tmp/quilt-mpi
#
# Unpacks nothing where an mpiexec is already on PATH, unless --force.
quilt_mpi_prefix() {
  local debs root=${1:-/tmp/quilt-mpi}
  debs=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.gpu-deps/mpi
  # Root in a container: Open MPI asks for consent (whichever Open MPI runs).
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  if [ "${2:-}" != --force ] && command -v mpiexec >/dev/null 2>&1; then
    echo "mpi-prefix: $(command -v mpiexec) is already on PATH: nothing to unpack"
    return 0
  fi
  if ! compgen -G "$debs/*.deb" >/dev/null; then
    echo "mpi-prefix: no $debs/*.deb (run tools/gpu-deps.sh where a package registry is reachable)"
    return 1
  fi
  mkdir -p "$root/bin"
  local f
  for f in "$debs"/*.deb; do dpkg -x "$f" "$root" || return 1; done
  # Debian names its binaries mpicxx.openmpi and so on (update-alternatives adds the plain
  # names on install, which unpacking skips).
  for f in mpicc mpicxx mpiexec mpirun; do ln -sf "$root/usr/bin/$f.openmpi" "$root/bin/$f"; done
  local lib=$root/usr/lib/x86_64-linux-gnu
  export PATH=$root/bin:$root/usr/bin:$PATH
  export LD_LIBRARY_PATH=$lib/openmpi/lib:$lib:$root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export OPAL_PREFIX=$root/usr                                # Open MPI's own files
  export PMIX_PREFIX=$lib/pmix2                               # PMIx's (a separate package)
  export PMIX_MCA_mca_base_component_path=$lib/pmix2/lib/pmix
  export HWLOC_PLUGINS_PATH=$root/no-hwloc-plugins            # not the system's, if any
  echo "mpi-prefix: Open MPI $("$root/usr/bin/ompi_info" --parsable 2>/dev/null | sed -n "s/^ompi:version:full://p" | head -n 1) in $root"
}
quilt_mpi_prefix "$@"
