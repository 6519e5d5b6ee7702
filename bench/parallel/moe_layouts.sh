#!/usr/bin/env bash
# MoE trainer throughput per layout, in one run on this machine: recipes/moe_tiny.yaml at 1,
# 2 and 4 ranks, with and without expert parallelism, beside the dense demo recipe at the same
# ranks for scale. Per layout: median tokens/s over the steps after warm-up, the median
# moe_load (busiest expert / mean) and the largest per-step host-memory peak on rank 0.
# Usage: bench/parallel/moe_layouts.sh BUILD [STEPS]
default_steps=25
source "$(dirname "$0")/common.sh"
common=(--set "data.path=$data/train_*.bin" --set data.val_path=none --set train.eval_every=0
        --set "train.steps=$steps" --set logging.every_steps=1000)
run() {  # run NAME NP RECIPE ARGS...
  local name=$1 np=$2 recipe=$3; shift 3
  "${mpi[@]}" -n "$np" "$quilt" train --config "recipes/$recipe.yaml" "${common[@]}" --set "logging.dir=$work/$name" "$@" \
    > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
}
summary() {  # summary NAME -> "tokens/s moe_load peak_MiB"
  python3 - "$work/$1/metrics.jsonl" "$warm" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
tps = statistics.median(r["tps"] for r in rows)
load = statistics.median(r.get("moe_load", 0) for r in rows)
peak = max(r["memory_gib"] for r in rows) * 1024
print(f"{tps:.0f} {load:.2f} {peak:.1f}")
PY
}
printf '%-30s %10s %10s %14s\n' "run" "tokens/s" "moe_load" "peak MiB (r0)"
row() { read -r tps load peak <<< "$(summary "$1")"; printf '%-30s %10s %10s %14s\n' "$2" "$tps" "$load" "$peak"; }
run moe1 1 moe_tiny;                                     row moe1 "moe_tiny, 1 rank"
run moe2 2 moe_tiny;                                     row moe2 "moe_tiny, fsdp 2"
run moe2ep 2 moe_tiny --set distributed.ep_size=2;       row moe2ep "moe_tiny, ep 2"
run moe4 4 moe_tiny;                                     row moe4 "moe_tiny, fsdp 4"
run moe4ep2 4 moe_tiny --set distributed.ep_size=2;      row moe4ep2 "moe_tiny, ep 2 x ep_shard 2"
run moe4ep4 4 moe_tiny --set distributed.ep_size=4;      row moe4ep4 "moe_tiny, ep 4"
run dense1 1 llama_tiny;                                 row dense1 "llama_tiny (dense), 1 rank"
run dense4 4 llama_tiny;                                 row dense4 "llama_tiny (dense), fsdp 4"
