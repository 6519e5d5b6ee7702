#!/usr/bin/env bash
# One pass of the tests that reach a GEMM, with the library QUILT_GEMM names forced (`make test`
# runs it once per installed library after the full ctest run): gemm_pass.sh BUILD_DIR JOBS
#
# Each doctest suite runs as one process with all its cases, where ctest starts one per case:
# with openblas forced a pass takes 37 s so against 52 s through ctest on the AVX2 EPYC. Cases
# run after one another in one process here, so state one case leaves behind that breaks a
# later one fails this pass too. The suites
# run JOBS at a time, each under a 30-minute limit; then ctest runs the multi-rank tests that are
# not doctest cases. Left out, as from the start: the collectives (no GEMM), the GEMM library
# tests (which loop over every library themselves), the trainer runs (two runs on the same
# backend compared with each other: the unit tests check each backend against float64), the
# launch tests and the recipe checks (no GEMM).
set -euo pipefail
build=$(cd "$1" && pwd) jobs=${2:-2}
: "${QUILT_GEMM:?gemm_pass.sh: set QUILT_GEMM to the library to force}"
logs=$build/gemm-pass/$QUILT_GEMM
rm -rf "$logs" && mkdir -p "$logs"
# The longest suite first. Each entry: binary (relative to BUILD_DIR) and doctest arguments.
suites=(
  "tests/dtensor_tests"
  "tests/engine_tests"
  "tests/parallel_tests"
  "tools/tools_tests"
  "tests/models_tests"
  "tests/kernels_tests --test-case-exclude=gemm?libraries:*"
)
# run_suite BIN [ARGS...]: one suite in its own folder (as ctest runs it), its output to a log.
run_suite() {
  local bin=$1 name log
  shift
  name=$(basename "$bin")
  log=$logs/$name.log
  if (cd "$(dirname "$build/$bin")" && timeout 1800 "./$name" "$@" > "$log" 2>&1); then
    echo "  $name: $(grep -m1 '^\[doctest\] test cases:' "$log" | tr -s ' ')"
  else
    tail -n 150 "$log"
    echo "  $name FAILED with QUILT_GEMM=$QUILT_GEMM (its whole output: $log)"
    return 1
  fi
}
status=0 running=0
for s in "${suites[@]}"; do
  read -ra args <<< "$s"  # no glob expansion of the doctest filters
  [ -x "$build/${args[0]}" ] || { echo "gemm_pass.sh: $build/${args[0]} is not built" >&2; exit 1; }
  if ((running >= jobs)); then
    wait -n || status=1
    running=$((running - 1))
  fi
  run_suite "${args[@]}" &
  running=$((running + 1))
done
while ((running > 0)); do
  wait -n || status=1
  running=$((running - 1))
done
(cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 900 \
  -E '^(engine|kernels|dtensor|parallel|models|tools)\.|^(collectives|kernels\.gemm libraries|trainer|tools: config check)' \
  -LE launch) || status=1
exit $status
