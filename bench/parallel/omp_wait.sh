#!/usr/bin/env bash
# OpenMP wait policy in a training step: tokens/s and CPU time (user + sys over wall, from
# /usr/bin/time) of `quilt train` with OMP_WAIT_POLICY unset (the process's own choice),
# active (workers spin between parallel regions), passive (they sleep at once) and libgomp's
# own default (GOMP_SPINCOUNT=300000: spin ~0.3 M polls, then sleep), for the demo recipe and
# the 12M Llama, as 1 rank x 2 threads and 2 ranks x 1 thread.
# Usage: [MODELS="demo 12m"] [LAYOUTS="1x2 2x1"] [POLICIES="unset gomp active passive"] \
#          bench/parallel/omp_wait.sh BUILD [STEPS]
default_steps=20
source "$(dirname "$0")/common.sh"
common=(--config recipes/llama_tiny.yaml --set "data.path=$data/train_*.bin" --set data.val_path=none
        --set train.eval_every=0 --set "train.steps=$steps" --set logging.every_steps=1000)
m12=(--set model.hidden_size=512 --set model.intermediate_size=1376 --set model.num_hidden_layers=4
     --set model.num_attention_heads=8 --set model.num_key_value_heads=4 --set model.max_position_embeddings=256
     --set train.seq_len=256 --set train.global_batch_size=8 --set train.micro_batch_size=4)
run() {  # run NAME NP THREADS POLICY ARGS... -> "tokens/s wall_s cpu_s"
  local name=$1 np=$2 threads=$3 policy=$4; shift 4
  local env=(env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT OMP_NUM_THREADS="$threads")  # options before assignments
  case $policy in
    unset) ;;
    gomp) env+=(GOMP_SPINCOUNT=300000) ;;
    *) env+=(OMP_WAIT_POLICY="$policy") ;;
  esac
  "${env[@]}" /usr/bin/time -f "%e %U %S" -o "$work/$name.time" "${mpi[@]}" -n "$np" "$quilt" train "${common[@]}" \
    --set "logging.dir=$work/$name" "$@" > "$work/$name.log" 2>&1 || { cat "$work/$name.log"; exit 1; }
  python3 - "$work/$name/metrics.jsonl" "$warm" "$work/$name.time" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][int(sys.argv[2]):]
wall, user, sys_ = map(float, open(sys.argv[3]).read().split()[-3:])
print(f"{statistics.median(r['tps'] for r in rows):.0f} {wall:.1f} {user + sys_:.1f}")
PY
}
printf '%-10s %-14s %-8s %10s %8s %8s %9s\n' model layout policy tokens/s wall_s cpu_s cpu/wall
for model in ${MODELS:-demo 12m}; do
  args=()
  [ "$model" = 12m ] && args=("${m12[@]}")
  for layout in ${LAYOUTS:-1x2 2x1}; do  # ranks x threads per rank
    np=${layout%x*} threads=${layout#*x}
    for policy in ${POLICIES:-unset gomp active passive}; do
      read -r tps wall cpu <<< "$(run "${model}_${np}_${policy}" "$np" "$threads" "$policy" "${args[@]}")"
      printf '%-10s %-14s %-8s %10s %8s %8s %9.2f\n' "$model" "${np}r x ${threads}t" "$policy" "$tps" "$wall" "$cpu" \
        "$(python3 -c "print($cpu / $wall)")"
    done
  done
done
