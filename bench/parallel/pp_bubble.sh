#!/usr/bin/env bash
# The idle share of each pipeline schedule at one pp size, repeated: RUNS runs per schedule,
# each tracing steps 3, 4 and 5 (`logging.trace`), so every schedule gets 3 x RUNS measured
# steps; prints the median and range of the measured idle share (1 - time in F/B/I/W /
# (ranks x step time), from the merged trace) next to the schedule's modelled share from the
# same log. The model is recipes/llama_tiny.yaml with 6 layers (8 layers at pp 4, so that
# v_schedule's 2 x pp stages each get a layer), 8 pipeline micro-batches of one sequence.
# Usage: bench/parallel/pp_bubble.sh BUILD [PP] [RUNS] [SCHEDULE...]
# Needs a core per rank for figures that measure the schedule rather than core sharing.
build=${1:-build}
pp=${2:-4}
runs=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
schedules=("$@")
[ ${#schedules[@]} -gt 0 ] || schedules=(gpipe 1f1b interleaved1f1b looped_bfs zero_bubble v_schedule)
set -- "$build" 6
source "$(dirname "$0")/common.sh"
layers=$(( pp >= 4 ? 8 : 6 ))
common=(--config recipes/llama_tiny.yaml --set "data.path=$data/train_*.bin" --set data.val_path=none
        --set train.eval_every=0 --set train.steps=6 --set logging.every_steps=1000
        --set "model.num_hidden_layers=$layers" --set "distributed.pp_size=$pp" --set train.micro_batch_size=8
        --set logging.trace=true --set "logging.trace_steps=[3,4,5]")
model="demo recipe (seq 128)"
if [ "${PP_BUBBLE_MODEL:-}" = 12m ]; then
  common+=("${m12[@]}" --set "model.num_hidden_layers=$layers")
  model="12M Llama (hidden 512, seq 256)"
fi
echo "pp $pp, $model, $layers layers, 8 micro-batches of 1 sequence, $runs runs x steps 3-5; $(nproc) cores"
printf '%-16s %26s %14s\n' "schedule" "measured idle, median (range)" "modelled idle"
for s in "${schedules[@]}"; do
  for r in $(seq "$runs"); do
    run "b_${s}_$r" "$pp" --set "distributed.pipeline.pp_schedule=$s"
  done
  modelled=$(sed -n 's/.*modelled idle share \([0-9.]*%\).*/\1/p' "$work/b_${s}_1.log" | head -1)
  cat "$work"/b_"$s"_*.log | sed -n 's/.*the ranks were idle \([0-9.]*\)%.*/\1/p' | python3 -c '
import statistics, sys
v = sorted(float(x) for x in sys.stdin.read().split())
name, modelled = sys.argv[1], sys.argv[2]
if not v:
    sys.exit(f"pp_bubble: no idle share in the logs of {name}")
print(f"{name:<16} {statistics.median(v):9.1f}% ({v[0]:.1f}-{v[-1]:.1f}, {len(v)} steps) {modelled:>14}")
' "$s" "$modelled"
done
