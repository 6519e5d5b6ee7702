// How a Llama becomes a parallel program: see parallelize.h.
#include "models/llama/parallelize.h"

#include "parallel/mixed_precision.h"

namespace quilt {

TensorParallelPlan llama_tp_plan(bool sequence_parallel, bool loss_parallel) {
  // The residual stream between blocks: replicated over tp, or cut along the sequence (SP).
  const Placement stream = sequence_parallel ? Placement(Shard(1)) : Placement(Replicate());
  TensorParallelPlan plan;
  plan.add("model.embed_tokens", RowwiseParallel{.input_layouts = Replicate(), .output_layouts = stream});
  for (const char* block : {"self_attn", "mlp"}) {
    const std::string norm = std::string("model.layers.*.") + (block == std::string("self_attn") ? "input_layernorm"
                                                                                             : "post_attention_layernorm");
    if (sequence_parallel) plan.add(norm, SequenceParallel{});
    // One layout change per block input (an all-gather under SP), shared by its projections,
    // whose input gradients then meet as one partial sum (one all-reduce in backward).
    PrepareModuleInput in{.input_layouts = {stream}, .desired_input_layouts = {Replicate()}};
    if (block == std::string("self_attn")) {  // (x, cos, sin): the rotary tables stay plain
      in.input_layouts.resize(3);
      in.desired_input_layouts.resize(3);
    }
    plan.add(std::string("model.layers.*.") + block, in);
  }
  for (const char* col : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"})
    plan.add(std::string("model.layers.*.") + col, ColwiseParallel{});
  for (const char* row : {"self_attn.o_proj", "mlp.down_proj"})
    plan.add(std::string("model.layers.*.") + row, RowwiseParallel{.output_layouts = stream});
  if (sequence_parallel) plan.add("model.norm", SequenceParallel{});
  plan.add("lm_head", ColwiseParallel{.input_layouts = stream,
                                      .output_layouts = loss_parallel ? Placement(Shard(-1)) : Placement(Replicate()),
                                      .use_local_output = !loss_parallel});
  return plan;
}

TensorParallelPlan llama_tp_plan_for(const LlamaForCausalLM& model, bool sequence_parallel, bool loss_parallel) {
  TensorParallelPlan plan = llama_tp_plan(sequence_parallel, loss_parallel);
  if (!model.has_embedding()) plan.erase("model.embed_tokens");
  if (!model.has_head()) {
    plan.erase("model.norm");
    plan.erase("lm_head");
  } else if (!model.lm_head) {
    // Tied: logits = h @ embed_tokens.weight^T with the weight vocab-parallel. The normed
    // hidden states enter that product as one replicated distributed tensor (so its input
    // gradient is one partial sum, all-reduced once); the logits come out Shard(-1).
    plan.erase("lm_head");
    const Placement stream = sequence_parallel ? Placement(Shard(1)) : Placement(Replicate());
    plan.add("model.norm", PrepareModuleOutput{.output_layouts = {stream},
                                               .desired_output_layouts = {Replicate()},
                                               .use_local_output = false});
    if (!loss_parallel)
      plan.add("", PrepareModuleOutput{.output_layouts = {Shard(-1)}, .desired_output_layouts = {Replicate()}});
  }
  if (model.model->layers->empty())
    std::erase_if(plan.entries, [](const auto& e) { return e.first.rfind("model.layers.", 0) == 0; });
  return plan;
}

const std::vector<std::string>& llama_fp32_modules() {
  static const std::vector<std::string> names = {"input_layernorm", "post_attention_layernorm", "model.norm"};
  return names;
}

DataParallelism parallelize_llama(LlamaForCausalLM& model, const Meshes& meshes, const DistributedConfig& dc,
                       const LlamaParallelizeOptions& opts) {
  // The order matters, as in torchtitan:
  // 1. TP first: it replaces parameters by tp-distributed tensors (and installs the layout
  //    hooks); FSDP then shards those over the data-parallel axes, so a weight is cut on tp
  //    and dp alike, and FSDP's all-gathers rebuild the tp shard, never the full weight.
  // 2. CP next: it only changes how attention sees the sequence (and the batch layout), not
  //    parameters, and must wrap attention before AC records what the block computes.
  // 3. AC before FSDP: the checkpoint wrapper then sits inside FSDP's pre/post-forward hooks,
  //    so one all-gather serves the region's forward and its recomputation reuses the weights
  //    FSDP gathers again before backward, instead of gathering inside the region.
  // 4. FSDP (or DDP) last: it wraps units around everything above, and the root last.
  const DeviceMesh tp = meshes["tp"];
  if (tp.size() > 1) apply_tp(model, tp, llama_tp_plan_for(model, dc.sequence_parallel, opts.loss_parallel));

  // apply_cp: not yet (context parallelism over meshes["cp"] lands with its issue).

  if (dc.activation_checkpointing && !model.model->layers->empty())
    apply_ac(model, {.mode = parse_ac_mode(dc.activation_checkpointing_mode), .modules = {"model.layers.*"}});

  // 4. Data parallelism. fsdp2 (megatron_fsdp runs as fsdp2's sharding): each decoder layer
  //    one unit, each norm its own f32 unit under mixed precision, then the root (embedding,
  //    head), over dp_shard x cp (HSDP: replicated over dp_replicate). ddp: replicate over dp.
  DataParallelism dp;
  const bool mixed = opts.param_dtype && *opts.param_dtype != DType::f32;
  if (dc.strategy == Strategy::kDdp) {
    QUILT_CHECK(!opts.output_dtype || opts.output_dtype == opts.param_dtype, "[train.output_dtype] ddp keeps module "
                "outputs in the compute dtype (train.param_dtype); use fsdp2 for another output dtype");
    if (mixed) {
      QUILT_CHECK(!model.config().tie_word_embeddings,
                  "[train.param_dtype] ddp with mixed precision and tie_word_embeddings is not supported (use fsdp2)");
      apply_mixed_precision(model, {.param_dtype = *opts.param_dtype});
    }
    if (meshes["dp"].size() > 1) dp.ddp = apply_ddp(model, meshes["dp"], {.reduce_dtype = opts.reduce_dtype});
    return dp;
  }
  FSDPPolicy policy;
  policy.param_dtype = opts.param_dtype;
  policy.reduce_dtype = opts.reduce_dtype;
  policy.output_dtype = opts.output_dtype;
  policy.reshard_after_forward = dc.reshard_after_forward;
  if (mixed) policy.fp32_modules = llama_fp32_modules();
  // HSDP: a 2-D mesh cut from the main one (the tp axis of its parameters lies beside it).
  DeviceMesh mesh = meshes["dp_shard_cp"];
  if (meshes.size("dp_replicate") > 1)
    mesh = meshes.size("cp") == 1 ? meshes.main.sub({"dp_replicate", "dp_shard"}) : meshes.sub({"dp_replicate", "dp_shard_cp"});
  std::vector<std::string> units;
  if (!model.model->layers->empty()) units.push_back("model.layers.*");
  dp.fsdp = apply_fsdp(model, mesh, policy, units);
  return dp;
}

}  // namespace quilt
