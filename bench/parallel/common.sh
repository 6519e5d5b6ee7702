# Sourced by the trainer-layout benches: BUILD and STEPS from the arguments, the corpus
# prepared once, mpiexec as the benches run it, and a scratch directory removed at exit.
set -euo pipefail
build=${1:-build}
steps=${2:-${default_steps:-30}}
warm=5
quilt=$build/bin/quilt
data=$build/data/fortunes
# QUILT_CORPUS: a directory of text files to use where Debian's fortunes are not installed.
[ -f "$data/train_000000.bin" ] ||
  "$quilt" data prepare --input "${QUILT_CORPUS:-/usr/share/games/fortunes}" --output "$data" > /dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=("${QUILT_MPIEXEC:-mpiexec}" --oversubscribe --bind-to none --mca btl vader,self --mca pml ob1 --mca mpi_yield_when_idle 1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The 12M-parameter Llama of the layout benches: hidden 512, 4 layers, intermediate 1376, 8 heads
# / 4 kv, seq 256, 8 sequences per step.
m12=(--set model.hidden_size=512 --set model.intermediate_size=1376 --set model.num_hidden_layers=4
     --set model.num_attention_heads=8 --set model.num_key_value_heads=4 --set model.max_position_embeddings=256
     --set train.seq_len=256 --set train.global_batch_size=8)
# run NAME NP ARGS...: `quilt train` with the script's ${common[@]} on NP ranks, logging into
# $work/NAME; prints the log and exits on failure.
run() {
  local name=$1 np=$2; shift 2
  "${mpi[@]}" -n "$np" "$quilt" train "${common[@]}" --set "logging.dir=$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log"; exit 1; }
}
