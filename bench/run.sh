#!/usr/bin/env bash
# make bench: the CPU benchmark suites on this machine, then the collectives suite under
# mpirun at 2 and 4 ranks (sizes to 16 MiB). Figures go to stdout; docs/PERF.md records them.
set -euo pipefail
build=${1:-build}
min_time=${QUILT_BENCH_MIN_TIME:-0.3}
for b in peak_bench matmul_bench elementwise_bench nn_bench fused_bench attention_bench; do
  echo "== $b"
  "$build/bench/$b" --benchmark_min_time="$min_time"
done
echo "== grouped_gemm_bench"; "$build/bench/grouped_gemm_bench"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for np in 2 4; do
  echo "== collectives_bench, $np ranks"
  mpiexec -n "$np" --oversubscribe --bind-to none --mca btl vader,self --mca pml ob1 --mca mpi_yield_when_idle 1 \
    "$build/bench/collectives_bench" --benchmark_min_time=0.05 --max_bytes=16777216
done
echo "== trainer layouts (fsdp2 vs ddp at 4 ranks, memory vs one rank)"
bash "$(dirname "$0")/parallel/layouts.sh" "$build"
echo "== context parallelism at seq 4096 (cp 1, 2, 4; ring, all_gather, a2a)"
bash "$(dirname "$0")/parallel/cp_layouts.sh" "$build"
echo "== MoE trainer layouts (moe_tiny at 1, 2, 4 ranks, with and without ep)"
bash "$(dirname "$0")/parallel/moe_layouts.sh" "$build"
for np in 2 4; do
  echo "== ep_dispatch_bench, $np ranks"
  mpiexec -n "$np" --oversubscribe --bind-to none --mca btl vader,self --mca pml ob1 --mca mpi_yield_when_idle 1 \
    "$build/bench/ep_dispatch_bench" --benchmark_min_time=0.5
done
