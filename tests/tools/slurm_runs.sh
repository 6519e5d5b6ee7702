#!/usr/bin/env bash
# Trainer runs under Slurm (tests/slurm.cmake registers each mode; tools/slurm-local.sh runs
# them inside a one-node cluster on this host, SLURM_CONF set):
#   losses   srun --mpi=pmix -n 4 prints the same losses as mpiexec -n 4, bit for bit, and
#            every rank took its rank, local rank and world from Slurm's environment
#   sbatch   recipes/slurm/train.sbatch, submitted with sbatch, runs to completion
#   killed   rank 2 killed with SIGKILL mid-run ends the job with non-zero status in under 60 s
#            (not at the 300 s collective timeout), and srun names task 2, only it, as killed
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
    # Long enough that rank 2 is killed mid-run; the collective timeout (300 s) is not what ends it:
    # --kill-on-bad-exit has slurmstepd end the other tasks once one dies. A SIGKILLed rank
    # cannot announce its failure, so the rank is named by srun ("srun: error: HOST: task 2:
    # Killed"); the survivors are only "Terminated". srun is started itself (not through
    # srun_quilt) so that $! is its pid, and it is stopped when a check fails before its end.
    srun --mpi=pmix --kill-on-bad-exit=1 -n 4 "$quilt" train "${common[@]}" --set train.steps=100000 \
      --set dist_env.timeout_s=300 --set "logging.dir=$work/killed" > "$work/killed.log" 2>&1 < /dev/null &
    job=$!
    running=1
    # On a failed check: srun ends its step, and whatever of the job is still there is ended here.
    stop_job() {
      [ $running -eq 1 ] && kill -TERM $job 2>/dev/null && sleep 2
      pkill -KILL -f -- "logging.dir=$work/killed" || true
    }
    trap 'stop_job; rm -rf "$work"' EXIT
    gone() { cat "$work/killed.log"; echo "$1"; exit 1; }
    for _ in $(seq 1 240); do grep -q "step: 2 " "$work/killed.log" && break; kill -0 $job 2>/dev/null || break; sleep 0.25; done
    grep -q "step: 2 " "$work/killed.log" || gone "the run did not reach step 2"
    victim=""
    # srun's command line matches too: only $quilt's processes (by executable: quilt re-executes
    # itself through /proc/self/exe, so its comm is "exe"; a rebuilt binary reads "(deleted)").
    exe=$(readlink -f "$quilt")
    for p in $(pgrep -f -- "logging.dir=$work/killed"); do
      [ "$(readlink "/proc/$p/exe" 2>/dev/null | sed 's/ (deleted)$//')" = "$exe" ] || continue
      # grep reads it all (no -q): under pipefail, tr's SIGPIPE would drop a match.
      tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -x "SLURM_PROCID=2" > /dev/null || continue
      [ -z "$victim" ] || gone "two processes of rank 2: $victim and $p"
      victim=$p
    done
    [ -n "$victim" ] || gone "no process of rank 2 found"
    start=$(date +%s.%N)
    kill -KILL "$victim"
    limit=60
    for _ in $(seq 1 $((limit * 10))); do kill -0 $job 2>/dev/null || break; sleep 0.1; done
    elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    kill -0 $job 2>/dev/null && gone "the job was still running $elapsed s after rank 2 was killed"
    set +e
    wait $job
    rc=$?
    set -e
    running=0
    cat "$work/killed.log"
    echo "---- the job ended with status $rc $elapsed s after rank 2 (pid $victim) was killed"
    [ $rc -ne 0 ] || { echo "the job exited with status 0"; exit 1; }
    awk -v e="$elapsed" -v m="$limit" 'BEGIN { exit !(e >= m) }' && { echo "the job took $elapsed s to end, not under $limit s"; exit 1; }
    grep -q "\[watchdog\]" "$work/killed.log" && { echo "the collective timeout ended the job, not rank 2's death"; exit 1; }
    # Exactly one "Killed" report and it is task 2's (the other tasks are reported Terminated).
    named=$(grep -Eo '^srun: error: [^ ]+: tasks? [0-9,-]+: Killed$' "$work/killed.log" | sed 's/^srun: error: [^ ]*: //' || true)
    [ "$named" = "task 2: Killed" ] || { echo "srun did not name task 2 (and only it) as killed: '${named//$'\n'/; }'"; exit 1; }
    left=""
    for _ in $(seq 1 20); do
      left=$(pgrep -f -- "logging.dir=$work/killed" || true)
      [ -z "$left" ] && break
      sleep 0.25
    done
    [ -z "$left" ] || { echo "processes left behind: $left"; exit 1; }
    ;;
  *) echo "slurm_runs.sh: unknown mode $mode"; exit 2 ;;
esac
echo "slurm_runs: $mode passed"
