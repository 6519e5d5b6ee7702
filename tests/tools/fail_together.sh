#!/usr/bin/env bash
# Trainer runs that must fail together (tests/trainer.cmake registers each case): the job exits
# non-zero within a bound, every given pattern is in its output, the last line any rank printed
# is the error ("quilt: error: ..."), no step ran when the failure is a start-up one, and no
# process of the job is left.
#   fail_together.sh QUILT MPIEXEC... -- CASE NP MAX_SECONDS PATTERN...
set -uo pipefail
quilt=$1; shift
mpi=()
while [ "$1" != "--" ]; do mpi+=("$1"); shift; done
shift
case_name=$1; np=$2; max_s=$3; shift 3
work=$(mktemp -d /tmp/quilt-fail-XXXXXX)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/tiny_run.sh"
common+=(--set train.steps=4 --set dist_env.timeout_s=300)  # only failing together ends these quickly
launch() { "${mpi[@]}" -n "$1" "$quilt" train "${common[@]}" "${@:2}"; }

# A checkpoint to damage: 4 ranks (fsdp 4), 2 steps.
saved() {
  launch 4 --set train.steps=2 --set "checkpoint.dir=$work/ck" --set "logging.dir=$work/log0" > "$work/save.log" 2>&1 ||
    { cat "$work/save.log"; echo "the run that saves the checkpoint failed"; exit 1; }
  ck=$work/ck/step_00000002
}
resume=(--set "checkpoint.dir=$work/ck" --set checkpoint.resume=auto)
startup=0
case "$case_name" in
  checkpoint_dir) args=(--set checkpoint.dir=/proc/quilt-no-such-dir --set checkpoint.every_steps=3); startup=1 ;;
  logging_dir) args=(--set logging.dir=/proc/quilt-no-such-dir); startup=1 ;;
  shard_truncated) saved; truncate -s 200 "$ck/rank-00002.safetensors"; args=("${resume[@]}") ;;
  shard_deleted) saved; rm "$ck/rank-00001.safetensors"; args=("${resume[@]}") ;;
  index_shifted)
    # The first chunk stored in rank 2's file moves one row down in the index.
    saved
    awk '!done && /"file": "rank-00002.safetensors"/ { at = NR }
         !done && at && NR == at + 2 { sub(/[0-9]+/, $1 + 1); done = 1 } { print }' "$ck/index.json" > "$work/index.json"
    cmp -s "$ck/index.json" "$work/index.json" && { echo "the index was not changed"; exit 1; }
    mv "$work/index.json" "$ck/index.json"
    args=("${resume[@]}") ;;
  metrics_disk_full)
    # Rank 0 alone writes metrics.jsonl; here it is /dev/full, so the write after step 1 fails
    # while the other ranks go on into step 2's collectives.
    mkdir -p "$work/log" && ln -s /dev/full "$work/log/metrics.jsonl"
    args=(--set "logging.dir=$work/log") ;;
  step_junk)
    saved
    sed -i 's/"trainer.step": "2"/"trainer.step": "2x"/' "$ck/index.json"
    grep -q '"trainer.step": "2x"' "$ck/index.json" || { echo "the index was not changed"; exit 1; }
    args=("${resume[@]}") ;;
  *) echo "fail_together.sh: unknown case $case_name"; exit 2 ;;
esac

start=$(date +%s.%N)
timeout -s KILL $((max_s + 60)) "${mpi[@]}" -n "$np" "$quilt" train "${common[@]}" "${args[@]}" > "$work/out.log" 2>&1 < /dev/null
rc=$?
elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
cat "$work/out.log"
echo "---- fail_together: $case_name on $np ranks: exit status $rc after $elapsed s (limit $max_s s)"
status=0
bad() { echo "fail_together: FAILED: $*" >&2; status=1; }
[ "$rc" -ne 0 ] || bad "the job exited with status 0"
awk -v e="$elapsed" -v m="$max_s" 'BEGIN { exit !(e > m) }' && bad "the job took $elapsed s, more than $max_s s"
for p in "$@"; do grep -Eq -- "$p" "$work/out.log" || bad "no output line matches: $p"; done
last=$(grep -E '^(\[rank [0-9]+\] )?quilt|^\[rank [0-9]+\]' "$work/out.log" | tail -1)
case "$last" in *"quilt: error: "*) ;; *) bad "the last line the ranks printed is not the error: $last" ;; esac
grep -q "\[watchdog\]" "$work/out.log" && bad "the watchdog had to end the job"
[ "$startup" -eq 1 ] && grep -q "step: 1 " "$work/out.log" && bad "a step ran before the start-up error"
left=""
for _ in $(seq 1 20); do
  left=$(pgrep -f -- "$work" || true)
  [ -z "$left" ] && break
  sleep 0.25
done
if [ -n "$left" ]; then
  bad "processes left behind: $(ps -o pid=,stat=,args= -p "$(echo $left | tr ' ' ',')" 2>/dev/null)"
  kill -KILL $left 2>/dev/null
fi
[ $status -eq 0 ] && echo "fail_together: passed"
exit $status
