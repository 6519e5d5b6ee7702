#!/usr/bin/env bash
# make demo: prepares the fortune(6) corpus (Debian's `fortunes` package) as token shards and
# trains the default recipe on 4 CPU ranks under mpiexec, printing the step lines.
set -euo pipefail
build=${1:-build}
shift || true
ranks=${QUILT_DEMO_RANKS:-4}
"$build/bin/quilt" data prepare --input /usr/share/games/fortunes --output "$build/data/fortunes"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Ranks share this machine's cores: no binding, shared-memory transport, yield when idle.
exec mpiexec -n "$ranks" --oversubscribe --bind-to none --mca btl vader,self --mca pml ob1 \
  --mca mpi_yield_when_idle 1 \
  "$build/bin/quilt" train --config recipes/llama_tiny.yaml \
  --set logging.dir="$build/demo" \
  --set "data.path=$build/data/fortunes/train_*.bin" --set "data.val_path=$build/data/fortunes/val_*.bin" "$@"
