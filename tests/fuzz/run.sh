#!/usr/bin/env bash
# Runs every fuzz target of a QUILT_FUZZ build for a bounded time, one after another:
#   run.sh BUILD_DIR [SECONDS_EACH (60)] [TARGET...]   (targets: safetensors, config, ...)
# Each starts from its checked-in seeds (corpus/<target>/, read only) plus what earlier runs
# found (BUILD_DIR/fuzz/corpus/<target>/), with <target>.dict as its dictionary when there is one. A crashing input is kept as
# BUILD_DIR/fuzz/crashes/<target>-crash-<sha1>; the run then fails, showing the report.
set -euo pipefail
build=$(cd "$1" && pwd) seconds=${2:-60}
shift $(($# < 2 ? $# : 2))
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../sanitize/env.sh"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || for f in "$here"/*_fuzz.cpp; do targets+=("$(basename "$f" _fuzz.cpp)"); done
mkdir -p "$build/fuzz/crashes"
for t in "${targets[@]}"; do
  mkdir -p "$build/fuzz/corpus/$t"
  log=$build/fuzz/$t.log
  dict=()
  [ -f "$here/$t.dict" ] && dict=(-dict="$here/$t.dict")
  if ! "$build/fuzz/${t}_fuzz" "${dict[@]}" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
       -artifact_prefix="$build/fuzz/crashes/$t-" "$build/fuzz/corpus/$t" "$here/corpus/$t" > "$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz: $t failed; the input is in $build/fuzz/crashes/ (log: $log)"
    exit 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  echo "fuzz: $t: $execs inputs in ${seconds} s, no report; corpus $(ls "$build/fuzz/corpus/$t" | wc -l) inputs"
done
