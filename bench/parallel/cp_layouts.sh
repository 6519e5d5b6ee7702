#!/usr/bin/env bash
# Context parallelism at long sequences, in one run on this machine: the 12M-parameter Llama
# (hidden 512, 4 layers, intermediate 1376, 8 heads / 4 kv) on one sequence of 4096 tokens per
# step, at cp 1 (one rank), cp 2 and cp 4 (ring attention, FSDP over dp_shard x cp), plus cp 4
# with all_gather and a2a. Per layout: median tokens/s over the steps after warm-up, rank 0's
# largest per-step peak of host memory, the parameter + gradient + optimizer state this rank
# holds (the trainer's start-up line), and activations = peak - state: what cp divides.
# Usage: bench/parallel/cp_layouts.sh BUILD [STEPS] [SEQ]
default_steps=6
source "$(dirname "$0")/common.sh"
warm=2
seq=${3:-4096}
common=(--config recipes/llama_tiny.yaml --set "data.path=$data/train_*.bin" --set data.val_path=none
        --set train.eval_every=0 --set "train.steps=$steps" --set logging.every_steps=1000
        --set model.hidden_size=512 --set model.intermediate_size=1376 --set model.num_hidden_layers=4
        --set model.num_attention_heads=8 --set model.num_key_value_heads=4
        --set "model.max_position_embeddings=$seq" --set "train.seq_len=$seq"
        --set train.global_batch_size=1 --set train.micro_batch_size=1 --set train.warmup_steps=2)
summary() {  # summary NAME -> "tokens/s peak_MiB state_MiB activations_MiB"
  python3 - "$work/$1/metrics.jsonl" "$warm" "$work/$1.log" <<'PY'
import json, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
tps = statistics.median(r["tps"] for r in rows)
peak = max(r["memory_gib"] for r in rows) * 1024
state = 0.0
for line in open(sys.argv[3]):
    m = re.search(r"\((\d+) KiB of parameters \+ gradients \+ optimizer state\)", line)
    if m:
        state = int(m.group(1)) / 1024
        break
print(f"{tps:.0f} {peak:.1f} {state:.1f} {peak - state:.1f}")
PY
}
printf '%-30s %10s %12s %12s %16s %10s\n' "run (seq $seq)" "tokens/s" "peak MiB" "state MiB" "activations MiB" "vs cp 1"
base=""
row() {
  read -r tps peak state act <<< "$(summary "$1")"
  [ -z "$base" ] && base=$act
  printf '%-30s %10s %12s %12s %16s %9.2fx\n' "$2" "$tps" "$peak" "$state" "$act" \
    "$(python3 -c "print($act / $base)")"
}
run cp1 1
run cp2 2 --set distributed.cp_size=2
run cp4 4 --set distributed.cp_size=4
run cp4ag 4 --set distributed.cp_size=4 --set distributed.cp_comm_type=all_gather
run cp4a2a 4 --set distributed.cp_size=4 --set distributed.cp_comm_type=a2a
row cp1 "cp 1 (one rank)"
row cp2 "cp 2, ring"
row cp4 "cp 4, ring"
row cp4ag "cp 4, all_gather"
row cp4a2a "cp 4, a2a"
