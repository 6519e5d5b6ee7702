# Sourced by the trainer-layout benches: BUILD and STEPS from the arguments, the corpus
# prepared once, mpiexec as the benches run it, and a scratch directory removed at exit.
set -euo pipefail
build=${1:-build}
steps=${2:-${default_steps:-30}}
warm=5
quilt=$build/bin/quilt
data=$build/data/fortunes
[ -f "$data/train_000000.bin" ] || "$quilt" data prepare --input /usr/share/games/fortunes --output "$data" > /dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=(mpiexec --oversubscribe --bind-to none --mca btl vader,self --mca pml ob1 --mca mpi_yield_when_idle 1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
