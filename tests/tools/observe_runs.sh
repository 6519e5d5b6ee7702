#!/usr/bin/env bash
# What a run shows besides its losses (tests/slurm.cmake registers each mode):
#   trace        logging.trace at fsdp 2 x tp 2: per-rank and merged Perfetto JSON with ops and
#                their shapes, collectives with bytes and mesh axis, FSDP gathers and
#                reduce-scatters, data loading and the optimizer, on every rank
#   tensorboard  logging.tensorboard: the events file reads back (CRCs, tags, values)
#   plot         quilt plot: a PNG for one run and for two; a missing file and a line that is
#                not JSON are refused, naming the file and the line
#   progress     quilt data prepare: plain progress lines when not a terminal, carriage-return
#                updates on one (a pty from script(1)); the step line's elapsed time and ETA;
#                the start-up report
# Usage: observe_runs.sh QUILT TOOLS_DIR MPIEXEC... -- MODE   (TOOLS_DIR: trace_check, tfevents_check)
set -euo pipefail
quilt=$1; tools=$2; shift 2
mpi=()
while [ "$1" != "--" ]; do mpi+=("$1"); shift; done
shift
mode=$1
work=$(mktemp -d /tmp/quilt-observe-XXXXXX)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/tiny_run.sh"
is_png() { [ -s "$1" ] && [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; }
refused() {  # refused EXPECTED_TEXT CMD...: CMD fails and prints the text
  local expect=$1; shift
  set +e
  out=$("$@" 2>&1)
  rc=$?
  set -e
  echo "$out"
  [ $rc -ne 0 ] || { echo "not refused: $*"; exit 1; }
  grep -qF -- "$expect" <<< "$out" || { echo "the refusal does not say: $expect"; exit 1; }
}

case "$mode" in
  trace)
    run traced 4 --set train.steps=2 --set distributed.tp_size=2 --set logging.trace=true --set "logging.trace_steps=[2]"
    grep "trace: step 2 in $work/traced/trace_step2.json" "$work/traced.log" || { cat "$work/traced.log"; exit 1; }
    kinds=(op:matmul "op:matmul backward" op:scaled_dot_product_attention op:embedding collective:all_gather
           collective:all_reduce "fsdp:fsdp all_gather " "fsdp:fsdp all_gather wait" "fsdp:fsdp reduce_scatter"
           "data:load batches" "optimizer:optimizer step" "optimizer:clip grad norm" "step:forward + backward")
    "$tools/trace_check" "$work/traced/trace_step2.json" 4 --has "${kinds[@]}"
    for r in 0 1 2 3; do
      "$tools/trace_check" "$work/traced/trace_step2_rank$r.json" 0 --has op:matmul > /dev/null ||
        { echo "trace_step2_rank$r.json is not a valid trace"; exit 1; }
    done
    # The mesh axes name the collectives: tp's all-reduces and dp_shard's gathers.
    grep -q '"axis":"tp"' "$work/traced/trace_step2.json" || { echo "no collective on axis tp"; exit 1; }
    grep -q '"axis":"dp_shard' "$work/traced/trace_step2.json" || { echo "no collective on axis dp_shard"; exit 1; }
    # Only the listed step is traced.
    [ "$(ls "$work/traced" | grep -c '^trace_step')" -eq 5 ] || { ls "$work/traced"; echo "expected 5 trace files"; exit 1; }
    ;;
  tensorboard)
    run tb 2 --set train.steps=3 --set logging.tensorboard=true
    events=$(ls "$work"/tb/events.out.tfevents.*)
    grep -qF "tensorboard: $events" "$work/tb.log" || { cat "$work/tb.log"; echo "the events file is not named"; exit 1; }
    "$tools/tfevents_check" "$events" "$work/tb/metrics.jsonl" loss lr grad_norm tps memory_gib
    # A damaged byte is caught by the data CRC.
    cp "$events" "$work/damaged"
    printf 'X' | dd of="$work/damaged" bs=1 seek=40 conv=notrunc status=none
    ! "$tools/tfevents_check" "$work/damaged" "$work/tb/metrics.jsonl" loss 2> "$work/damaged.err" ||
      { echo "a damaged events file passed"; exit 1; }
    grep -q "CRC does not match" "$work/damaged.err" || { cat "$work/damaged.err"; exit 1; }
    refused "logging.tensorboard needs logging.dir" "$quilt" train "${common[@]}" --set logging.tensorboard=true
    ;;
  plot)
    run a 1 --set train.steps=4
    run b 2 --set train.steps=4 --set train.lr=1e-3
    "$quilt" plot "$work/a/metrics.jsonl" -o "$work/one.png"
    is_png "$work/one.png" || { echo "one.png is not a PNG"; exit 1; }
    "$quilt" plot "$work/a/metrics.jsonl" "$work/b/metrics.jsonl" -o "$work/two.png" --metrics loss,lr,grad_norm,tps
    is_png "$work/two.png" || { echo "two.png is not a PNG"; exit 1; }
    [ "$(stat -c %s "$work/two.png")" -gt "$(stat -c %s "$work/one.png")" ] || { echo "four panels are not larger than one"; exit 1; }
    refused "[plot] $work/nothere.jsonl does not exist" "$quilt" plot "$work/nothere.jsonl" -o "$work/x.png"
    { head -2 "$work/a/metrics.jsonl"; echo "step: 3  loss: 2.1"; } > "$work/bad.jsonl"
    refused "[plot] $work/bad.jsonl:3 is not JSON" "$quilt" plot "$work/a/metrics.jsonl" "$work/bad.jsonl" -o "$work/x.png"
    echo '{"loss": 1.0}' > "$work/nostep.jsonl"
    refused "[plot] $work/nostep.jsonl:1 has no integer \"step\"" "$quilt" plot "$work/nostep.jsonl" -o "$work/x.png"
    refused "no line of $work/a/metrics.jsonl has \"bogus\"" "$quilt" plot "$work/a/metrics.jsonl" -o "$work/x.png" --metrics bogus
    [ ! -e "$work/x.png" ] || { echo "a refused plot wrote its output"; exit 1; }
    ;;
  progress)
    # A corpus of ~12 MB (the fortunes, 30 times), so that preparing it takes several updates.
    mkdir -p "$work/big"
    for i in $(seq 1 30); do cat "$work"/text/* > "$work/big/part$i.txt"; done
    QUILT_PROGRESS_EVERY_S=0.02 "$quilt" data prepare --input "$work/big" --output "$work/bigdata" \
      > "$work/prep.out" 2> "$work/prep.err"
    cat "$work/prep.err"
    n=$(grep -cE '^data prepare: [0-9.]+ MiB of [0-9.]+ MiB \([0-9.]+%\), [0-9]+ documents, [0-9]+ tokens, [0-9]+ tokens/s, eta ' "$work/prep.err" || true)
    [ "$n" -ge 2 ] || { echo "expected plain progress lines with bytes, documents, tokens/s and eta, got $n"; exit 1; }
    grep -qE '^data prepare: .* \(100\.0%\), .*, took ' "$work/prep.err" || { echo "no final progress line"; exit 1; }
    ! grep -q $'\r' "$work/prep.err" || { echo "carriage returns in a log"; exit 1; }
    # On a terminal the line is rewritten in place.
    script -qec "'$quilt' data prepare --input '$work/big' --output '$work/bigdata2'" /dev/null \
      > "$work/tty.out" < /dev/null
    [ "$(tr -cd '\r' < "$work/tty.out" | wc -c)" -ge 2 ] || { cat -A "$work/tty.out" | head; echo "no carriage-return updates on a terminal"; exit 1; }
    # The trainer: elapsed time and ETA on every step line, and the start-up report.
    run steps 2 --set train.steps=3
    cat "$work/steps.log"
    [ "$(grep -cE 'step: [0-9]+ .*  elapsed: [0-9]+s  eta: [0-9]+s' "$work/steps.log")" -eq 3 ] ||
      { echo "the step lines lack elapsed and eta"; exit 1; }
    grep -qE 'step: 3 .*eta: 0s' "$work/steps.log" || { echo "the last step's eta is not 0s"; exit 1; }
    grep -qE '^\[rank 0\] gemm: .*, [0-9]+ threads per rank' "$work/steps.log" || { echo "no gemm/threads line"; exit 1; }
    grep -qE '^\[rank 0\] launch: mpirun, rank 0 of 2, local rank 0 of 2' "$work/steps.log" || { echo "no launch line"; exit 1; }
    grep -qE '^\[rank 0\] memory per rank: parameters [0-9.]+ KiB, gradients [0-9.]+ KiB, optimizer [0-9.]+ KiB, FSDP gathers [0-9.]+ KiB, activations [0-9.]+ [KM]iB; expected peak ~[0-9.]+ [KM]iB' \
      "$work/steps.log" || { echo "no memory report"; exit 1; }
    ;;
  *) echo "observe_runs.sh: unknown mode $mode"; exit 2 ;;
esac
echo "observe_runs: $mode passed"
