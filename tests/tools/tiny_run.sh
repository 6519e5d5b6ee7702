# Sourced by the whole-run trainer scripts (trainer_runs.sh, fail_together.sh): with $quilt and
# $work set, prepares a small corpus (a few fortune files) in $work/data and sets `common`, the
# arguments of a tiny model that keep each run to seconds.
mkdir -p "$work/text"
for f in art computers science; do cp "${QUILT_CORPUS:-/usr/share/games/fortunes}/$f" "$work/text/"; done
"$quilt" data prepare --input "$work"/text/* --output "$work/data" > /dev/null
common=(--config "$(dirname "${BASH_SOURCE[0]}")/../../recipes/llama_tiny.yaml"
  --set "data.path=$work/data/train_*.bin" --set "data.val_path=none" --set train.eval_every=0
  --set model.hidden_size=64 --set model.intermediate_size=160 --set model.num_hidden_layers=2
  --set model.num_attention_heads=4 --set model.num_key_value_heads=2 --set train.seq_len=32
  --set model.max_position_embeddings=64 --set train.global_batch_size=4 --set train.micro_batch_size=1
  --set train.warmup_steps=2 --set logging.every_steps=1)
# run NAME NP [--set ...]: `quilt train` on NP ranks (${mpi[@]}) with the tiny setup, logging
# into $work/NAME; prints the log and exits on failure.
run() {  # run NAME NP [--set ...]
  local name=$1 np=$2; shift 2
  "${mpi[@]}" -n "$np" "$quilt" train "${common[@]}" --set "logging.dir=$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log"; echo "run $name failed"; exit 1; }
}
