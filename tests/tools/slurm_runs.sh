#!/usr/bin/env bash
# Trainer runs under Slurm (tests/slurm.cmake registers each mode; tools/slurm-local.sh runs
# them inside a one-node cluster on this host, SLURM_CONF set):
#   losses   srun --mpi=pmix -n 4 prints the same losses as mpiexec -n 4, bit for bit, and
#            every rank took its rank, local rank and world from Slurm's environment
#   sbatch   recipes/slurm/train.sbatch, submitted with sbatch, runs to completion
#   killed   a rank killed with SIGKILL mid-run ends the job within seconds, the rank named
# Usage: slurm_runs.sh QUILT METRICS_COMPARE MPIEXEC... -- MODE
set -euo pipefail
quilt=$1; compare=$2; shift 2
mpi=()
while [ "$1" != "--" ]; do mpi+=("$1"); shift; done
shift
mode=$1
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
[ -n "${SLURM_CONF:-}" ] || { echo "slurm_runs.sh: SLURM_CONF is not set (run it under tools/slurm-local.sh run --)"; exit 2; }
work=$(mktemp -d /tmp/quilt-slurm-test-XXXXXX)
trap 'rm -rf "$work"' EXIT
source "$here/tiny_run.sh"
# The node has fewer CPUs than ranks: tasks overcommit them, and idle ranks yield.
export SLURM_OVERCOMMIT=1 SBATCH_OVERCOMMIT=1 OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=vader,self OMPI_MCA_pml=ob1
srun_quilt() { srun --mpi=pmix --kill-on-bad-exit=1 "$@"; }
losses() { grep -o 'step: [0-9]*  loss: [0-9.na]*' "$1"; }

case "$mode" in
  losses)
    "${mpi[@]}" -n 4 "$quilt" train "${common[@]}" --set train.steps=6 --set "logging.dir=$work/mpi" > "$work/mpi.log" 2>&1 ||
      { cat "$work/mpi.log"; echo "the mpiexec run failed"; exit 1; }
    QUILT_LOG_RANKS=all srun_quilt -n 4 "$quilt" train "${common[@]}" --set train.steps=6 --set "logging.dir=$work/srun" \
      > "$work/srun.log" 2>&1 || { cat "$work/srun.log"; echo "the srun run failed"; exit 1; }
    cat "$work/srun.log"
    "$compare" "$work/mpi/metrics.jsonl" "$work/srun/metrics.jsonl" 0
    diff <(losses "$work/mpi.log") <(grep '^\[rank 0\]' "$work/srun.log" | losses /dev/stdin) ||
      { echo "the step lines differ"; exit 1; }
    [ "$(losses "$work/mpi.log" | wc -l)" -eq 6 ] || { echo "expected 6 step lines"; exit 1; }
    for r in 0 1 2 3; do
      grep -qF "[rank $r] launch: srun, rank $r of 4, local rank $r of 4" "$work/srun.log" ||
        { echo "rank $r did not report Slurm's rank, local rank and world"; exit 1; }
    done
    ;;
  sbatch)
    # The example as a user submits it, from the repository, with the tiny run's arguments.
    set +e
    (cd "$repo" && QUILT="$quilt" sbatch --wait --output="$work/job.out" recipes/slurm/train.sbatch "${common[@]:2}" \
      --set train.steps=4 --set "logging.dir=$work/job") > "$work/sbatch.log" 2>&1
    rc=$?
    set -e
    cat "$work/sbatch.log" "$work/job.out"
    [ $rc -eq 0 ] || { echo "sbatch --wait exited with status $rc"; exit 1; }
    grep -q "quilt: job [0-9]* on 1 node(s) (.*), 4 ranks" "$work/job.out" || { echo "no job line"; exit 1; }
    grep -q "step: 4  loss: " "$work/job.out" || { echo "the job did not reach step 4"; exit 1; }
    [ "$(wc -l < "$work/job/metrics.jsonl")" -eq 4 ] || { echo "metrics.jsonl does not have 4 steps"; exit 1; }
    ;;
  killed)
    # Long enough that rank 2 is killed mid-run; the collective timeout (300 s) is not what ends it.
    srun_quilt -n 4 "$quilt" train "${common[@]}" --set train.steps=100000 --set dist_env.timeout_s=300 \
      --set "logging.dir=$work/killed" > "$work/killed.log" 2>&1 < /dev/null &
    job=$!
    for _ in $(seq 1 240); do grep -q "step: 2 " "$work/killed.log" && break; sleep 0.25; done
    grep -q "step: 2 " "$work/killed.log" || { cat "$work/killed.log"; kill $job; echo "the run did not reach step 2"; exit 1; }
    victim=""
    for p in $(pgrep -f -- "logging.dir=$work/killed"); do
      tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "SLURM_PROCID=2" && [ "$(cat /proc/$p/comm)" = quilt ] &&
        victim=$p
    done
    [ -n "$victim" ] || { kill $job; echo "no process of rank 2 found"; exit 1; }
    start=$(date +%s.%N)
    kill -KILL "$victim"
    set +e
    timeout 60 tail --pid=$job -f /dev/null
    wait $job
    rc=$?
    set -e
    elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    cat "$work/killed.log"
    echo "---- the job ended with status $rc $elapsed s after rank 2 was killed"
    [ $rc -ne 0 ] || { echo "the job exited with status 0"; exit 1; }
    awk -v e="$elapsed" 'BEGIN { exit !(e > 20) }' && { echo "the job took more than 20 s to end"; exit 1; }
    grep -Eq "task 2: Killed|rank 2" "$work/killed.log" || { echo "rank 2 is not named"; exit 1; }
    sleep 1
    left=$(pgrep -f -- "logging.dir=$work/killed" || true)
    [ -z "$left" ] || { kill -KILL $left; echo "processes left behind: $left"; exit 1; }
    ;;
  *) echo "slurm_runs.sh: unknown mode $mode"; exit 2 ;;
esac
echo "slurm_runs: $mode passed"
