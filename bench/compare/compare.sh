#!/usr/bin/env bash
# The same Llama trained on the same batches by Quilt's trainer and by PyTorch (Debian's
# python3-torch, installed here when missing), one rank, the same thread count on both sides;
# prints per-step losses side by side and both sides' tokens/s with their ratio. Configs: the
# demo recipe (recipes/llama_tiny.yaml) and a 12.5M-parameter Llama (hidden 512, 4 layers,
# intermediate 1376, 8 / 4 heads, vocab 320, 8 sequences of 256 per step). See README.md.
#
# Usage: bench/compare/compare.sh [--quilt BIN] [--threads N] [--steps N] [--warmup N]
#                                 [--rounds R] [--only demo|12m] [--torch-foreach on|off|auto]
#                                 [--keep DIR] [--set KEY=VALUE]...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
quilt=build/bin/quilt threads=2 steps=20 warmup=5 rounds=1 only="" keep="" foreach=on extra=()
while [ $# -gt 0 ]; do
  case $1 in
    --quilt) quilt=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    --torch-foreach) foreach=$2; shift 2 ;;
    --set) extra+=(--set "$2"); shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "compare.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ "$steps" -gt "$warmup" ] || { echo "compare.sh: --steps ($steps) must exceed --warmup ($warmup)" >&2; exit 2; }
cd "$root"

# Set-up: packages (never part of make test), the quilt binary.
apt_install() {
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "compare.sh: installing $* (Debian packages)" >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y "$@" > /dev/null
}
/usr/bin/python3 -c 'import torch' 2> /dev/null || apt_install python3-torch libopenblas0-pthread
[ -d /usr/share/games/fortunes ] || apt_install fortunes
if [ ! -x "$quilt" ]; then
  build=$(dirname "$(dirname "$quilt")")
  [ -f "$build/build.ninja" ] || cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release > /dev/null
  cmake --build "$build" -j "$(nproc)" --target quilt_cli > /dev/null
fi
quilt=$(cd "$(dirname "$quilt")" && pwd)/$(basename "$quilt")

# The same threads on both sides: OpenMP (Quilt's kernels and Eigen GEMM, PyTorch's ops; the
# torch side also calls torch.set_num_threads) and OpenBLAS (PyTorch's GEMM, Quilt's when
# built with it). OpenBLAS misdetects some AVX-512 CPUs (then ~50x slower): name the core.
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
if [ -z "${OPENBLAS_CORETYPE:-}" ] && grep -m1 '^flags' /proc/cpuinfo | grep -qw avx512f; then
  export OPENBLAS_CORETYPE=SkylakeX
fi

if [ -n "$keep" ]; then work=$keep; mkdir -p "$work"; else work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi
"$quilt" data prepare --input /usr/share/games/fortunes --output "$work/data" > /dev/null

base=(--config recipes/llama_tiny.yaml --set "data.path=$work/data/train_*.bin" --set data.val_path=none
      --set train.eval_every=0 --set "train.steps=$steps" --set logging.every_steps=1000000)
m12=(--set model.hidden_size=512 --set model.intermediate_size=1376 --set model.num_hidden_layers=4
     --set model.num_attention_heads=8 --set model.num_key_value_heads=4 --set model.max_position_embeddings=256
     --set train.seq_len=256 --set train.global_batch_size=8 --set train.micro_batch_size=8)

export COMPARE_SUMMARY=$work/summary.md
: > "$COMPARE_SUMMARY"
compare() {  # compare NAME TITLE RECIPE-OVERRIDES...
  local name=$1 title=$2 dir=$work/$1
  shift 2
  local sets=("${base[@]}" "$@" "${extra[@]}")
  mkdir -p "$dir"
  # The effective recipe: the torch side reads its batch, optimizer, schedule and data keys.
  "$quilt" config check "${sets[@]}" --world 1 > "$dir/recipe.yaml"
  local tokens
  tokens=$(awk '/^train:/{t=1} t&&/^  global_batch_size:/{g=$2} t&&/^  seq_len:/{s=$2} END{print g*s}' "$dir/recipe.yaml")
  # Quilt's own initialisation, exported once as a HF checkpoint; both sides start from it.
  "$quilt" train "${sets[@]}" --set train.steps=0 --set "checkpoint.dir=$dir/init" \
    --set checkpoint.save_consolidated=true > "$dir/init.log" 2>&1 || { cat "$dir/init.log"; exit 1; }
  local q_runs="" t_runs=""
  for r in $(seq 1 "$rounds"); do
    "$quilt" train "${sets[@]}" --set "model.pretrained=$dir/init/hf" --set "logging.dir=$dir/quilt$r" \
      > "$dir/quilt$r.log" 2>&1 || { cat "$dir/quilt$r.log"; exit 1; }
    /usr/bin/python3 "$here/torch_llama.py" --recipe "$dir/recipe.yaml" --hf "$dir/init/hf" --threads "$threads" \
      --foreach "$foreach" --out "$dir/torch$r.jsonl" > "$dir/torch$r.log" 2>&1 || { cat "$dir/torch$r.log"; exit 1; }
    q_runs+=${q_runs:+,}$dir/quilt$r/metrics.jsonl
    t_runs+=${t_runs:+,}$dir/torch$r.jsonl
  done
  echo
  echo "== $title: $(grep -m1 '^# model:' "$dir/recipe.yaml" | sed 's/^# model: //'), $threads threads, 1 rank =="
  grep -m1 '^# batch:' "$dir/recipe.yaml" | sed 's/^# //'
  /usr/bin/python3 "$here/report.py" "$title" "$tokens" "$warmup" "$q_runs" "$t_runs"
}

echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(grep -m1 '^flags' /proc/cpuinfo |
  grep -ow -e avx2 -e avx512f | tr '\n' ' ')$(nproc) cpus; torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)');" \
  "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}; torch AdamW foreach $foreach; $steps steps, first $warmup untimed, $rounds round(s) per side;" \
  "load average $(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "$only" ] && [ "$only" != demo ] && [ "$only" != 12m ] && { echo "compare.sh: --only demo|12m" >&2; exit 2; }
[ "$only" = 12m ] || compare demo "demo recipe (llama_tiny.yaml)"
[ "$only" = demo ] || compare 12m "12M Llama" "${m12[@]}"
echo
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| config | quilt tokens/s | torch tokens/s | quilt/torch | max rel loss diff | max rel grad-norm diff |"
echo "| --- | --- | --- | --- | --- | --- |"
cat "$COMPARE_SUMMARY"
