#!/usr/bin/env bash
# Pipeline parallelism on this machine, in one run:
#  1. tokens/s of the demo recipe and of the 12M Llama at pp 2 and pp 4 (1f1b, one stage per
#     rank) against fsdp2 on the same number of ranks, median over the steps after warm-up;
#  2. the idle share of every schedule at pp 2 and pp 4 (8 micro-batches of one sequence,
#     6 layers): measured from the trace of step 3 (1 - time in F/B/I/W / (ranks x step)), next
#     to the schedule's modelled share (F 1, B 2, I 1, W 1) from the same log (skipped with
#     PP_LAYOUTS_BUBBLE=0; pp_bubble.sh repeats it for medians).
# Usage: bench/parallel/pp_layouts.sh BUILD [STEPS]
default_steps=12
source "$(dirname "$0")/common.sh"
warm=4
common=(--config recipes/llama_tiny.yaml --set "data.path=$data/train_*.bin" --set data.val_path=none
        --set train.eval_every=0 --set "train.steps=$steps" --set logging.every_steps=1000)
tps() {  # tps NAME -> median tokens/s after warm-up
  python3 - "$work/$1/metrics.jsonl" "$warm" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
print(f"{statistics.median(r['tps'] for r in rows):.0f}")
PY
}
printf '%-44s %10s %10s\n' "run" "tokens/s" "vs fsdp"
pair() {  # pair LABEL NP ARGS... : fsdp2 and pp NP (1f1b), the same global batch
  local label=$1 np=$2; shift 2
  run "f$label$np" "$np" "$@" --set train.micro_batch_size=$((8 / np))
  run "p$label$np" "$np" "$@" --set "distributed.pp_size=$np" --set train.micro_batch_size=8
  local f p
  f=$(tps "f$label$np"); p=$(tps "p$label$np")
  printf '%-44s %10s %10s\n' "$label, fsdp2 $np" "$f" "1.00x"
  printf '%-44s %10s %9.2fx\n' "$label, pp $np (1f1b, 8 micro-batches of 1)" "$p" "$(python3 -c "print($p / $f)")"
}
pair demo 2
pair demo 4
pair 12M 2 "${m12[@]}"
pair 12M 4 "${m12[@]}"
[ "${PP_LAYOUTS_BUBBLE:-1}" = 1 ] || exit 0
echo
printf '%-20s %4s %14s %14s\n' "schedule" "pp" "measured idle" "modelled idle"
for pp in 2 4; do
  for s in gpipe 1f1b interleaved1f1b looped_bfs zero_bubble v_schedule; do
    name="b_${s}_$pp"
    run "$name" "$pp" --set model.num_hidden_layers=6 --set "distributed.pp_size=$pp" \
      --set "distributed.pipeline.pp_schedule=$s" --set train.micro_batch_size=8 --set train.steps=4 \
      --set logging.trace=true --set "logging.trace_steps=[3]"
    measured=$(sed -n 's/.*the ranks were idle \([0-9.]*%\).*/\1/p' "$work/$name.log" | head -1)
    modelled=$(sed -n 's/.*modelled idle share \([0-9.]*%\).*/\1/p' "$work/$name.log" | head -1)
    printf '%-20s %4s %14s %14s\n' "$s" "$pp" "$measured" "$modelled"
  done
done
