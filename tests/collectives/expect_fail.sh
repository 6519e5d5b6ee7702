#!/usr/bin/env bash
# Runs a multi-rank command that must fail: asserts a non-zero exit within a time bound, that
# the output matches every given pattern, and that no process of the job is left behind.
#
#   expect_fail.sh <max-seconds> <pattern> [<pattern> ...] -- mpiexec -n 3 ./collectives_fault skip
#
# A unique marker argument is appended to the command so leftover processes can be found even
# when other tests run the same program at the same time.
set -u
max_s=$1
shift
patterns=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  patterns+=("$1")
  shift
done
[ "${1:-}" = "--" ] || { echo "expect_fail: missing -- before the command" >&2; exit 2; }
shift

marker="quilt-expect-fail-$$-$RANDOM"
log=$(mktemp)
start=$(date +%s.%N)
# The outer kill only guards the test itself; the job is expected to end well before it.
timeout -s KILL $((max_s + 30)) "$@" "$marker" >"$log" 2>&1 </dev/null
rc=$?
end=$(date +%s.%N)
elapsed=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
cat "$log"
echo "---- expect_fail: exit status $rc after ${elapsed} s (limit ${max_s} s)"

status=0
if [ "$rc" -eq 0 ]; then
  echo "expect_fail: FAILED: the job exited with status 0" >&2
  status=1
fi
if awk -v e="$elapsed" -v m="$max_s" 'BEGIN { exit !(e > m) }'; then
  echo "expect_fail: FAILED: the job took ${elapsed} s, more than ${max_s} s" >&2
  status=1
fi
for p in "${patterns[@]}"; do
  if ! grep -Eq -- "$p" "$log"; then
    echo "expect_fail: FAILED: no output line matches: $p" >&2
    status=1
  fi
done

# Give the launcher a moment to reap its children, then look for any survivor.
left=""
for _ in $(seq 1 20); do
  left=$(pgrep -f -- "$marker" || true)
  [ -z "$left" ] && break
  sleep 0.25
done
if [ -n "$left" ]; then
  echo "expect_fail: FAILED: processes left behind: $(ps -o pid=,stat=,args= -p $(echo $left | tr ' ' ',') 2>/dev/null)" >&2
  kill -CONT $left 2>/dev/null
  kill -KILL $left 2>/dev/null
  status=1
fi
rm -f "$log"
[ $status -eq 0 ] && echo "expect_fail: passed"
exit $status
