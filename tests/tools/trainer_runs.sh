#!/usr/bin/env bash
# Trainer tests that compare whole runs (tests/trainer.cmake registers each mode):
#   equivalence LAYOUT NP SETS...  a run under the layout follows the one-rank loss curve
#   determinism                    the same layout twice gives bit-identical losses
#   resume                         10 steps straight == 5 steps, stop, resume, 5 more (bit-identical)
#   cuda, cuda_ranks               train.device cuda on one GPU / a GPU per rank against the host
#                                  (exit 77, skipped, where no GPU is usable)
# Usage: trainer_runs.sh QUILT METRICS_COMPARE MPIEXEC... -- MODE ARGS...
set -euo pipefail
quilt=$1; compare=$2; shift 2
mpi=()
while [ "$1" != "--" ]; do mpi+=("$1"); shift; done
shift
mode=$1; shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/tiny_run.sh"
case "$mode" in
  equivalence)
    layout=$1; np=$2; shift 2
    run one 1 --set train.steps=8
    run "$layout" "$np" --set train.steps=8 "$@"
    # Reduction order differs between layouts (dp averages partial means): a few ulps of f32
    # per step, compounding through 8 Adam steps; 1e-4 bounds it with margin.
    "$compare" "$work/one/metrics.jsonl" "$work/$layout/metrics.jsonl" 1e-4
    ;;
  equivalence_deep)
    # As equivalence, with 6 layers in both runs (enough for 8 pipeline stages).
    layout=$1; np=$2; shift 2
    run one 1 --set train.steps=8 --set model.num_hidden_layers=6
    run "$layout" "$np" --set train.steps=8 --set model.num_hidden_layers=6 "$@"
    "$compare" "$work/one/metrics.jsonl" "$work/$layout/metrics.jsonl" 1e-4
    ;;
  equivalence_kv4)
    # As equivalence, with 4 key/value heads in both runs (a2a context parallelism over 4 ranks
    # cuts them over cp).
    layout=$1; np=$2; shift 2
    run one 1 --set train.steps=8 --set model.num_key_value_heads=4
    run "$layout" "$np" --set train.steps=8 --set model.num_key_value_heads=4 "$@"
    "$compare" "$work/one/metrics.jsonl" "$work/$layout/metrics.jsonl" 1e-4
    ;;
  equivalence_packed)
    # Packed rows (64 tokens, documents padded to a multiple of 8 in both runs, as cp 4 needs):
    # the layout follows the one-rank curve, validation included.
    layout=$1; np=$2; shift 2
    pack=(--set train.seq_len=64 --set packed_sequence.packed_sequence_size=64 --set packed_sequence.document_multiple=8
          --set "data.val_path=$work/data/val_*.bin" --set train.eval_every=4 --set train.eval_steps=2)
    run one 1 --set train.steps=8 "${pack[@]}"
    run "$layout" "$np" --set train.steps=8 "${pack[@]}" "$@"
    "$compare" "$work/one/metrics.jsonl" "$work/$layout/metrics.jsonl" 1e-4
    grep -q "validation: step 8  loss: [0-9]" "$work/$layout.log" || { cat "$work/$layout.log"; echo "no finite validation loss"; exit 1; }
    ;;
  equivalence_bf16)
    # bf16 compute (f32 masters, f32 loss): both runs round the same products to bf16 except
    # where the layout splits a reduction, so the curves agree to bf16's 2^-8 relative step.
    layout=$1; np=$2; shift 2
    run one 1 --set train.steps=8 --set train.param_dtype=bfloat16
    run "$layout" "$np" --set train.steps=8 --set train.param_dtype=bfloat16 "$@"
    "$compare" "$work/one/metrics.jsonl" "$work/$layout/metrics.jsonl" 2e-3
    ;;
  determinism)
    run a 2 --set train.steps=6 --set distributed.strategy=ddp
    run b 2 --set train.steps=6 --set distributed.strategy=ddp
    "$compare" "$work/a/metrics.jsonl" "$work/b/metrics.jsonl" 0
    ;;
  cuda)
    # train.device cuda: one GPU against the same run on the host, f32 and bf16 weights, and a
    # checkpoint saved from the GPU that a GPU run resumes. Without a usable GPU the run must
    # stop at once naming the key; the test then reports itself skipped (exit 77).
    if ! "${mpi[@]}" -n 1 "$quilt" train "${common[@]}" --set train.device=cuda --set train.steps=1 --set "logging.dir=$work/probe" \
        > "$work/probe.log" 2>&1; then
      grep -q "train.device cuda: no usable GPU" "$work/probe.log" || { cat "$work/probe.log"; exit 1; }
      echo "skipped: $(grep -o 'train.device cuda: no usable GPU.*' "$work/probe.log" | head -n 1)"
      exit 77
    fi
    run host 1 --set train.steps=8
    run gpu 1 --set train.steps=8 --set train.device=cuda
    grep -q "memory: " "$work/gpu.log" || { cat "$work/gpu.log"; exit 1; }
    # f32 on both sides; the reduction order differs between the devices (8 Adam steps).
    "$compare" "$work/host/metrics.jsonl" "$work/gpu/metrics.jsonl" 1e-3
    run host_bf16 1 --set train.steps=8 --set train.param_dtype=bfloat16
    run gpu_bf16 1 --set train.steps=8 --set train.param_dtype=bfloat16 --set train.device=cuda
    "$compare" "$work/host_bf16/metrics.jsonl" "$work/gpu_bf16/metrics.jsonl" 2e-2
    run first 1 --set train.steps=8 --stop-after 4 --set train.device=cuda --set "checkpoint.dir=$work/ckpt"
    test -d "$work/ckpt/step_00000004" || { echo "no checkpoint at step 4"; ls -la "$work/ckpt"; exit 1; }
    run second 1 --set train.steps=8 --set train.device=cuda --set "checkpoint.dir=$work/ckpt" --set checkpoint.resume=auto
    grep -q "resumed from" "$work/second.log" || { cat "$work/second.log"; echo "did not resume"; exit 1; }
    # The resumed GPU run continues the straight one (same kernels, same order).
    "$compare" "$work/gpu/metrics.jsonl" "$work/second/metrics.jsonl" 1e-6 5
    # train.cuda_graphs: steps 1-2 eager, step 3 captured, 3-10 replays of it, with the lr schedule
    # moving every step (staged, not captured) and 2 micro-batches (global 4 = 2 x 2: the second
    # backward adds into the first's gradients inside the graph); the same kernels in the same
    # order as the eager GPU run, so the same curve.
    acc=(--set train.steps=10 --set train.device=cuda --set train.micro_batch_size=2)
    run gpu_acc 1 "${acc[@]}"
    run graphs 1 "${acc[@]}" --set train.cuda_graphs=true
    grep -q "train.cuda_graphs: step 3 captured" "$work/graphs.log" || { cat "$work/graphs.log"; echo "no capture"; exit 1; }
    "$compare" "$work/gpu_acc/metrics.jsonl" "$work/graphs/metrics.jsonl" 1e-6
    # A checkpoint written after replays (step 5) resumes: steps 6-7 eager, 8 captured, 8-10
    # replays, continuing the same curve.
    run gfirst 1 "${acc[@]}" --stop-after 5 --set train.cuda_graphs=true --set "checkpoint.dir=$work/gckpt"
    run gsecond 1 "${acc[@]}" --set train.cuda_graphs=true --set "checkpoint.dir=$work/gckpt" --set checkpoint.resume=auto
    grep -q "train.cuda_graphs: step 8 captured" "$work/gsecond.log" || { cat "$work/gsecond.log"; echo "no capture"; exit 1; }
    "$compare" "$work/graphs/metrics.jsonl" "$work/gsecond/metrics.jsonl" 1e-6 6
    ;;
  cuda_ranks)
    # train.device cuda on several ranks: each rank on its GPU (local rank % the GPUs visible),
    # under fsdp, hsdp, ddp, tp, pp, cp and (MoE) ep, against the one-rank host curve. Over MPI (collectives through
    # host memory) ranks may share a GPU, so this runs on a one-GPU machine; over NCCL (a GPU per
    # rank) where the machine has 2 GPUs, and a third rank on 2 GPUs is refused naming the ranks.
    # Without a usable GPU the first run must stop at once naming the key; then exit 77 (skipped).
    if ! "${mpi[@]}" -n 2 "$quilt" train "${common[@]}" --set train.device=cuda --set train.steps=1 \
        --set "logging.dir=$work/probe" > "$work/probe.log" 2>&1; then
      grep -q "train.device cuda: no usable GPU" "$work/probe.log" || { cat "$work/probe.log"; exit 1; }
      echo "skipped: $(grep -o 'train.device cuda: no usable GPU.*' "$work/probe.log" | head -n 1)"
      exit 77
    fi
    grep -q "device: cuda:.*collectives over mpi through host memory" "$work/probe.log" ||
      { cat "$work/probe.log"; echo "no device line"; exit 1; }
    # follows REF NAME NP [--set ...]: NAME on NP ranks follows REF's curve. f32 on both sides;
    # reduction orders differ between devices and layouts (6 Adam steps).
    follows() {
      local ref=$1 name=$2; shift 2
      run "$name" "$@"
      "$compare" "$work/$ref/metrics.jsonl" "$work/$name/metrics.jsonl" 1e-3
    }
    run host 1 --set train.steps=6
    gpu=(--set train.steps=6 --set train.device=cuda)
    follows host mpi_fsdp2 2 "${gpu[@]}"
    follows host mpi_ddp2 2 "${gpu[@]}" --set distributed.strategy=ddp
    follows host mpi_tp2 2 "${gpu[@]}" --set distributed.tp_size=2
    follows host mpi_hsdp4 4 "${gpu[@]}" --set distributed.dp_replicate_size=2
    follows host mpi_pp2 2 "${gpu[@]}" --set distributed.pp_size=2 --set train.micro_batch_size=4
    # Context parallelism at cp 2: all_gather and a2a on the tiny model; ring runs the fused
    # kernels, whose head dims are 64 or 128, so a wider model (hidden 128, 2 heads of 64).
    follows host mpi_cp2ag 2 "${gpu[@]}" --set distributed.cp_size=2 --set distributed.cp_comm_type=all_gather
    follows host mpi_cp2a2a 2 "${gpu[@]}" --set distributed.cp_size=2 --set distributed.cp_comm_type=a2a
    wide=(--set model.hidden_size=128 --set model.num_attention_heads=2 --set model.num_key_value_heads=2)
    run wide_host 1 --set train.steps=6 "${wide[@]}"
    follows wide_host mpi_cp2ring 2 "${gpu[@]}" "${wide[@]}" --set distributed.cp_size=2
    # The GPUs the ranks see (CUDA_VISIBLE_DEVICES and MIG included), from the probe's device line.
    gpus=$(grep -o '[0-9]* GPUs visible' "$work/probe.log" | head -n 1 | cut -d' ' -f1)
    nccl=("${gpu[@]}" --set dist_env.backend=nccl)
    if [ "${gpus:-0}" -ge 2 ]; then
      follows host nccl_fsdp2 2 "${nccl[@]}"
      grep -q "collectives over nccl" "$work/nccl_fsdp2.log" || { cat "$work/nccl_fsdp2.log"; exit 1; }
      follows host nccl_tp2 2 "${nccl[@]}" --set distributed.tp_size=2
      follows host nccl_ddp2 2 "${nccl[@]}" --set distributed.strategy=ddp
      follows host nccl_pp2 2 "${nccl[@]}" --set distributed.pp_size=2 --set train.micro_batch_size=4
      grep -q "pipeline: transfers over mpi through host memory" "$work/nccl_pp2.log" || { cat "$work/nccl_pp2.log"; exit 1; }
      follows wide_host nccl_cp2ring 2 "${nccl[@]}" "${wide[@]}" --set distributed.cp_size=2
      if [ "$gpus" -eq 2 ]; then
        if "${mpi[@]}" -n 3 "$quilt" train "${common[@]}" "${nccl[@]}" --set train.global_batch_size=3 \
            --set "logging.dir=$work/shared" > "$work/shared.log" 2>&1; then
          echo "three NCCL ranks on two GPUs were not refused"; exit 1
        fi
        grep -q "ranks 0 and 2 share the GPU" "$work/shared.log" || { cat "$work/shared.log"; exit 1; }
      fi
    else
      echo "nccl: not run (this machine has ${gpus:-0} GPU; the nccl backend needs a GPU per rank)"
    fi
    # Last, MoE (recipes/moe_tiny.yaml shrunk as moe_equivalence does, in place of the dense
    # recipe from here on): experts over 2 ranks, the dispatch's counts, reorder indices and
    # grouped GEMM offsets on the GPUs.
    common=(--config "$(dirname "$0")/../../recipes/moe_tiny.yaml" "${common[@]:2}" --set model.moe_intermediate_size=32)
    run moe_host 1 --set train.steps=6
    follows moe_host mpi_ep2 2 "${gpu[@]}" --set distributed.ep_size=2
    if [ "${gpus:-0}" -ge 2 ]; then follows moe_host nccl_ep2 2 "${nccl[@]}" --set distributed.ep_size=2; fi
    ;;
  resume)
    run straight 2 --set train.steps=10 --set distributed.strategy=ddp
    run first 2 --set train.steps=10 --stop-after 5 --set distributed.strategy=ddp --set "checkpoint.dir=$work/ckpt"
    test -d "$work/ckpt/step_00000005" || { echo "no checkpoint at step 5"; ls -la "$work/ckpt"; exit 1; }
    run second 2 --set train.steps=10 --set distributed.strategy=ddp --set "checkpoint.dir=$work/ckpt" \
      --set checkpoint.resume=auto
    grep -q "resumed from" "$work/second.log" || { cat "$work/second.log"; echo "did not resume"; exit 1; }
    "$compare" "$work/straight/metrics.jsonl" "$work/second/metrics.jsonl" 0 6
    "$compare" "$work/straight/metrics.jsonl" "$work/first/metrics.jsonl" 0
    ;;
  reshard)
    # Saved under FSDP 4, resumed under FSDP 2 x TP 2: the curve continues the one-rank run's.
    run straight 1 --set train.steps=10
    run first 4 --set train.steps=10 --stop-after 5 --set distributed.strategy=fsdp2 --set "checkpoint.dir=$work/ckpt"
    run second 4 --set train.steps=10 --set distributed.tp_size=2 --set "checkpoint.dir=$work/ckpt" \
      --set checkpoint.resume=auto --set checkpoint.save_consolidated=true
    grep -q "resumed from .* (saved as mesh: world=4 dp_replicate=1 dp_shard=4" "$work/second.log" || { cat "$work/second.log"; exit 1; }
    grep -q "mesh: world=4 dp_replicate=1 dp_shard=2 cp=1 tp=2" "$work/second.log" || { cat "$work/second.log"; exit 1; }
    "$compare" "$work/straight/metrics.jsonl" "$work/second/metrics.jsonl" 1e-4 6
    # The consolidated export holds HF-named full weights and a config.json.
    test -f "$work/ckpt/hf/config.json" || { echo "no config.json"; exit 1; }
    grep -q '"model_type": "llama"' "$work/ckpt/hf/config.json"
    "$quilt" inspect --file "$work/ckpt/hf/model.safetensors" | grep -q "model.layers.1.mlp.down_proj.weight (64, 160)" ||
      { echo "HF export lacks model.layers.1.mlp.down_proj.weight (64, 160)"; exit 1; }
    ;;
  resume_fsdp)
    run straight 2 --set train.steps=10
    run first 2 --set train.steps=10 --stop-after 5 --set "checkpoint.dir=$work/ckpt"
    run second 2 --set train.steps=10 --set "checkpoint.dir=$work/ckpt" --set checkpoint.resume=auto
    grep -q "resumed from" "$work/second.log" || { cat "$work/second.log"; echo "did not resume"; exit 1; }
    "$compare" "$work/straight/metrics.jsonl" "$work/second/metrics.jsonl" 0 6
    ;;
  nonfinite)
    # An absurd learning rate blows the weights up after one update; the following steps'
    # non-finite loss or gradient must be skipped on every rank, with a message, not crash.
    run blowup 2 --set train.steps=4 --set train.lr=1e30 --set train.warmup_steps=0 --set train.max_grad_norm=none
    grep -q "step skipped on every rank" "$work/blowup.log" || { cat "$work/blowup.log"; echo "no skip message"; exit 1; }
    grep -q '"skipped":true' "$work/blowup/metrics.jsonl" || { cat "$work/blowup/metrics.jsonl"; exit 1; }
    ;;
  resume_pp)
    # Under pp 2 (1f1b): 10 steps straight equal 5, resume, 5 more, bit for bit; the pp 2
    # checkpoint of step 5 resumes at one rank and at fsdp 4 and follows the straight curve.
    pp=(--set distributed.pp_size=2 --set train.micro_batch_size=4)
    run straight 2 --set train.steps=10 "${pp[@]}"
    run first 2 --set train.steps=10 --stop-after 5 "${pp[@]}" --set "checkpoint.dir=$work/ckpt"
    test -d "$work/ckpt/step_00000005" || { echo "no checkpoint at step 5"; ls -la "$work/ckpt"; exit 1; }
    run second 2 --set train.steps=10 "${pp[@]}" --set "checkpoint.dir=$work/ckpt" --set checkpoint.resume=auto
    grep -q "resumed from" "$work/second.log" || { cat "$work/second.log"; echo "did not resume"; exit 1; }
    "$compare" "$work/straight/metrics.jsonl" "$work/second/metrics.jsonl" 0 6
    for layout in "one 1" "fsdp4 4"; do
      set -- $layout
      run "at_$1" "$2" --set train.steps=10 --set "checkpoint.resume=$work/ckpt/step_00000005"
      "$compare" "$work/straight/metrics.jsonl" "$work/at_$1/metrics.jsonl" 1e-4 6
    done
    ;;
  pp_trace)
    # logging.trace at pp 2: the merged trace of step 2 has one process per rank and each rank's
    # compute actions as slices (trace_check, built beside metrics_compare).
    schedule=$1; slices=$2
    run traced 2 --set train.steps=2 --set distributed.pp_size=2 --set distributed.pipeline.pp_schedule=$schedule \
      --set train.micro_batch_size=4 --set logging.trace=true --set "logging.trace_steps=[2]"
    grep "pipeline trace: step 2" "$work/traced.log" || { cat "$work/traced.log"; exit 1; }
    "$(dirname "$compare")/trace_check" "$work/traced/trace_step2.json" 2 "$slices"
    test -f "$work/traced/trace_step2_rank1.json"
    ;;
  skip_limit)
    # With train.max_skipped_steps 3, a checkpoint every step and keep_last 1, a run whose
    # steps turn non-finite after the first stops non-zero after 3 skipped steps in a row, naming
    # the key; the checkpoints saved after skipped steps never pushed out step 1's (the last good
    # one). With a learning rate beyond f32 the first update makes the weights inf: validation
    # prints nan and even step 1's checkpoint is marked (keep_last then deletes nothing).
    blowup() {  # blowup NAME LR
      set +e
      "${mpi[@]}" -n 2 "$quilt" train "${common[@]}" --set "logging.dir=$work/$1" --set train.steps=20 \
        --set train.lr=$2 --set train.warmup_steps=0 --set train.max_grad_norm=none --set train.max_skipped_steps=3 \
        --set "data.val_path=$work/data/val_*.bin" --set train.eval_every=1 --set train.eval_steps=1 \
        --set "checkpoint.dir=$work/$1/ck" --set checkpoint.every_steps=1 --set checkpoint.keep_last=1 > "$work/$1.log" 2>&1
      rc=$?
      set -e
      cat "$work/$1.log"
      [ $rc -ne 0 ] || { echo "the run did not stop"; exit 1; }
      grep -q "quilt: error: \[train\] 3 steps in a row (up to step 4) had a non-finite loss or gradient norm and were skipped; stopping (train.max_skipped_steps: 3)" \
        "$work/$1.log" || { echo "no stop message"; exit 1; }
      ! grep -q "step: 5 " "$work/$1.log" || { echo "steps ran past the limit"; exit 1; }
      ls "$work/$1/ck"
      for s in 1 2 3; do test -d "$work/$1/ck/step_0000000$s" || { echo "checkpoint $s is missing"; exit 1; }; done
    }
    # First, a healthy run: keep_last 2 leaves the two newest.
    run healthy 2 --set train.steps=4 --set "checkpoint.dir=$work/healthy/ck" --set checkpoint.every_steps=1 \
      --set checkpoint.keep_last=2
    [ "$(ls "$work/healthy/ck" | tr '\n' ' ')" = "step_00000003 step_00000004 " ] || { ls "$work/healthy/ck"; exit 1; }
    blowup big 1e30
    grep -q "saved .*step_00000002 (after a skipped step: not counted by keep_last)" "$work/big.log" || exit 1
    blowup inf 1e39
    grep -q "validation: step 2  loss: nan" "$work/inf.log" || { echo "validation did not print nan"; exit 1; }
    grep -q "saved .*step_00000001 (non-finite weights: not counted by keep_last)" "$work/inf.log" || exit 1
    # Resuming passes over checkpoints with non-finite weights: here every one has them, so the
    # load of the newest is refused, naming the tensor.
    set +e
    "${mpi[@]}" -n 2 "$quilt" train "${common[@]}" --set "logging.dir=$work/again" --set train.steps=6 \
      --set "checkpoint.dir=$work/inf/ck" --set checkpoint.resume=auto > "$work/again.log" 2>&1
    rc=$?
    set -e
    cat "$work/again.log"
    [ $rc -ne 0 ] && grep -q "passing over .*step_00000003 (saved with non-finite weights)" "$work/again.log" &&
      grep -q "(a floating tensor must load finite values)" "$work/again.log" || { echo "resume did not refuse"; exit 1; }
    ;;
  pretrained)
    # Start from Hugging Face weights (model.pretrained): a 3-step run exports HF files; loading
    # them with train.steps 0 and exporting again gives the same bytes in every layout, a
    # fine-tuning run from them follows the one-rank curve, and a recipe field that contradicts
    # config.json stops the run, naming the field.
    run source 1 --set train.steps=3 --set "checkpoint.dir=$work/src" --set checkpoint.save_consolidated=true
    hf=$work/src/hf
    test -f "$hf/model.safetensors" -a -f "$hf/config.json" || { ls -R "$work/src"; exit 1; }
    for layout in "one 1" "fsdp4 4 --set distributed.strategy=fsdp2" "fsdp2tp2 4 --set distributed.tp_size=2" \
                  "ddp2 2 --set distributed.strategy=ddp"; do
      set -- $layout; name=$1; np=$2; shift 2
      run "rt_$name" "$np" --set train.steps=0 --set "model.pretrained=$hf" --set "checkpoint.dir=$work/rt_$name" \
        --set checkpoint.save_consolidated=true "$@"
      grep -q "model: weights from" "$work/rt_$name.log" || { cat "$work/rt_$name.log"; exit 1; }
      cmp "$hf/model.safetensors" "$work/rt_$name/hf/model.safetensors" || { echo "round trip under $name differs"; exit 1; }
    done
    run ft_one 1 --set train.steps=4 --set "model.pretrained=$hf"
    run ft_fsdp4 4 --set train.steps=4 --set "model.pretrained=$hf"
    "$compare" "$work/ft_one/metrics.jsonl" "$work/ft_fsdp4/metrics.jsonl" 1e-4
    if "${mpi[@]}" -n 2 "$quilt" train "${common[@]}" --set "model.pretrained=$hf" --set model.intermediate_size=96 \
         > "$work/bad.log" 2>&1; then
      cat "$work/bad.log"; echo "a contradicting recipe was accepted"; exit 1
    fi
    grep -q "model.intermediate_size" "$work/bad.log" || { cat "$work/bad.log"; echo "the field is not named"; exit 1; }
    ;;
  deferred_init)
    # Under fsdp2 each rank materialises only its shards: the host memory a rank allocates while
    # building and initialising a 13 MB model stays under half of it at 4 ranks, while ddp
    # (which builds the whole model) needs all of it.
    big=(--set model.hidden_size=256 --set model.intermediate_size=688 --set model.num_hidden_layers=4
         --set train.steps=2)
    run deferred 4 "${big[@]}" --set distributed.strategy=fsdp2
    run deferred_tp 4 "${big[@]}" --set distributed.strategy=fsdp2 --set distributed.tp_size=2
    run eager 2 "${big[@]}" --set distributed.strategy=ddp
    for name in deferred deferred_tp eager; do
      line=$(grep "host memory peak while building" "$work/$name.log") || { cat "$work/$name.log"; exit 1; }
      peak=$(echo "$line" | sed 's/.*building: \([0-9]*\) KiB.*/\1/'); full=$(echo "$line" | sed 's/.*parameters: \([0-9]*\) KiB.*/\1/')
      echo "$name: peak $peak KiB while building, full parameters $full KiB"
      if [ "$name" != eager ]; then [ "$peak" -lt $((full / 2)) ] || { echo "deferred init materialised too much"; exit 1; }
      else [ "$peak" -ge "$full" ] || { echo "the eager build should hold the whole model"; exit 1; }; fi
    done
    ;;
  moe_equivalence)
    # recipes/moe_tiny.yaml shrunk like the dense runs: 8 experts top-2 in both layers (qk norms,
    # aux-loss-free balancing on), under a layout against one rank.
    layout=$1; np=$2; shift 2
    common=(--config "$(dirname "$0")/../../recipes/moe_tiny.yaml" "${common[@]:2}" --set model.moe_intermediate_size=32)
    run one 1 --set train.steps=8
    run "$layout" "$np" --set train.steps=8 "$@"
    grep -q "moe_load" "$work/one.log" || { cat "$work/one.log"; echo "no moe_load in the step line"; exit 1; }
    "$compare" "$work/one/metrics.jsonl" "$work/$layout/metrics.jsonl" 1e-4
    ;;
  moe_equivalence_bf16)
    # As moe_equivalence in bf16 compute (f32 masters; the norms f32 units inside the
    # embedding's own unit under wrap_outer_model): bf16's 2^-8 relative step bounds the gap.
    layout=$1; np=$2; shift 2
    common=(--config "$(dirname "$0")/../../recipes/moe_tiny.yaml" "${common[@]:2}" --set model.moe_intermediate_size=32
            --set train.param_dtype=bfloat16)
    run one 1 --set train.steps=8
    run "$layout" "$np" --set train.steps=8 "$@"
    "$compare" "$work/one/metrics.jsonl" "$work/$layout/metrics.jsonl" 2e-3
    ;;
  moe_resume)
    # Saved under ep 2 (experts and the balancing bias distributed), resumed under ep 4: the
    # curve continues the straight run's.
    common=(--config "$(dirname "$0")/../../recipes/moe_tiny.yaml" "${common[@]:2}" --set model.moe_intermediate_size=32)
    run straight 4 --set train.steps=8 --set distributed.ep_size=2
    run first 4 --set train.steps=8 --stop-after 4 --set distributed.ep_size=2 --set "checkpoint.dir=$work/ckpt"
    run second 4 --set train.steps=8 --set distributed.ep_size=4 --set "checkpoint.dir=$work/ckpt"
    grep -q "resumed from .* (saved as .* ep=2)" "$work/second.log" || { cat "$work/second.log"; echo "did not resume"; exit 1; }
    "$compare" "$work/straight/metrics.jsonl" "$work/second/metrics.jsonl" 1e-4 5
    ;;
  moe_export)
    # HF export of a trained MoE: one tensor per expert under HF names, which loads back under
    # another layout and exports bit-identically.
    common=(--config "$(dirname "$0")/../../recipes/moe_tiny.yaml" "${common[@]:2}" --set model.moe_intermediate_size=32)
    run first 4 --set train.steps=3 --set distributed.ep_size=2 --set "checkpoint.dir=$work/ckpt" \
      --set checkpoint.save_consolidated=true
    "$quilt" inspect --file "$work/ckpt/hf/model.safetensors" > "$work/inspect.txt"
    grep -q "model.layers.1.mlp.experts.7.down_proj.weight (64, 32)" "$work/inspect.txt" ||
      { cat "$work/inspect.txt"; echo "HF export lacks expert 7's down_proj"; exit 1; }
    if grep -q "mlp.experts.gate_proj" "$work/inspect.txt"; then echo "a grouped tensor leaked into the HF export"; exit 1; fi
    grep -q '"model_type": "qwen3_moe"' "$work/ckpt/hf/config.json"
    run second 4 --set train.steps=0 --set distributed.ep_size=4 --set "model.pretrained=$work/ckpt/hf" \
      --set "checkpoint.dir=$work/ckpt2" --set checkpoint.save_consolidated=true
    cmp "$work/ckpt/hf/model.safetensors" "$work/ckpt2/hf/model.safetensors" ||
      { echo "HF weights in under ep 4 and out again differ"; exit 1; }
    ;;
  packing)
    # Packed rows of whole documents (packed_sequence.packed_sequence_size = train.seq_len, one
    # row per micro-batch): finite losses, validation packed too; fsdp 2 reads the same rows
    # between its ranks and follows the one-rank curve; 8 steps straight equal 4, resume, 4 more,
    # bit for bit (fortunes are longer than a row, so the saved cursor sits inside a document).
    pack=(--set train.seq_len=64 --set packed_sequence.packed_sequence_size=64 --set "data.val_path=$work/data/val_*.bin"
          --set train.eval_every=4 --set train.eval_steps=2 --set distributed.strategy=fsdp2)
    run one 1 --set train.steps=8 "${pack[@]}"
    run fsdp2 2 --set train.steps=8 "${pack[@]}"
    "$compare" "$work/one/metrics.jsonl" "$work/fsdp2/metrics.jsonl" 1e-4
    grep -q "validation: step 8  loss: [0-9]" "$work/one.log" || { cat "$work/one.log"; echo "no finite validation loss"; exit 1; }
    run first 2 --set train.steps=8 --stop-after 4 "${pack[@]}" --set "checkpoint.dir=$work/ckpt"
    grep -rqE 'offset[\\"]*:[1-9]' "$work/ckpt/step_00000004" || { echo "the saved cursor is not inside a document"; exit 1; }
    run second 2 --set train.steps=8 "${pack[@]}" --set "checkpoint.dir=$work/ckpt" --set checkpoint.resume=auto
    grep -q "resumed from" "$work/second.log" || { cat "$work/second.log"; echo "did not resume"; exit 1; }
    "$compare" "$work/fsdp2/metrics.jsonl" "$work/second/metrics.jsonl" 0 5
    ;;
  *) echo "unknown mode $mode"; exit 2 ;;
esac
