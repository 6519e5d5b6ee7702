#!/usr/bin/env bash
# Trainer throughput and memory per layout, in one run on this machine: fsdp2 against ddp at
# 4 ranks, for the demo recipe and a 12M-parameter Llama, plus the one-rank run of the 12M
# model for the memory ratio. Per layout: median tokens/s and median all-gather wait per step
# over the steps after warm-up, and the largest per-step peak of host memory on rank 0.
# Usage: bench/parallel/layouts.sh BUILD [STEPS]
default_steps=30
source "$(dirname "$0")/common.sh"
common=(--config recipes/llama_tiny.yaml --set "data.path=$data/train_*.bin" --set data.val_path=none
        --set train.eval_every=0 --set "train.steps=$steps" --set logging.every_steps=1000)
summary() {  # summary NAME -> "tokens/s gather_wait_ms peak_MiB"
  python3 - "$work/$1/metrics.jsonl" "$warm" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
tps = statistics.median(r["tps"] for r in rows)
wait = statistics.median(r.get("gather_wait_s", 0) for r in rows) * 1e3
peak = max(r["memory_gib"] for r in rows) * 1024
print(f"{tps:.0f} {wait:.1f} {peak:.1f}")
PY
}
printf '%-34s %10s %16s %14s\n' "run" "tokens/s" "gather wait/step" "peak MiB (r0)"
row() { read -r tps wait peak <<< "$(summary "$1")"; printf '%-34s %10s %13s ms %14s\n' "$2" "$tps" "$wait" "$peak"; }
run demo_ddp 4 --set distributed.strategy=ddp
run demo_fsdp 4 --set distributed.strategy=fsdp2
row demo_ddp "demo recipe, ddp 4"
row demo_fsdp "demo recipe, fsdp2 4"
run m12_ddp 4 "${m12[@]}" --set train.micro_batch_size=2 --set distributed.strategy=ddp
run m12_fsdp 4 "${m12[@]}" --set train.micro_batch_size=2 --set distributed.strategy=fsdp2
row m12_ddp "12M, ddp 4 (micro-batch 2)"
row m12_fsdp "12M, fsdp2 4 (micro-batch 2)"
# Memory: the same global batch of 8 per step; one rank takes it as one micro-batch of 8, each
# of 4 ranks takes its 2 (and as 4 micro-batches of 2, the same activations as a rank of fsdp 4).
run m12_one_mb8 1 "${m12[@]}" --set train.micro_batch_size=8
run m12_one_mb2 1 "${m12[@]}" --set train.micro_batch_size=2
row m12_one_mb8 "12M, one rank (micro-batch 8)"
row m12_one_mb2 "12M, one rank (micro-batch 2)"
