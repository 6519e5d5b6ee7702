// How a Llama becomes a parallel program: see parallelize.h.
#include "models/llama/parallelize.h"

#include "dtensor/dtensor.h"
#include "engine/engine.h"
#include "parallel/context_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/fully_shard.h"
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
    if (block == std::string("self_attn")) {  // (x, cos, sin, positions, documents): all but x stay plain
      in.input_layouts.resize(5);
      in.desired_input_layouts.resize(5);
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
  // MoE layers: the block takes its input replicated (the PrepareModuleInput above) and gives
  // a Partial output, laid out as the residual stream again. The dense MLP entries apply to
  // dense layers only.
  const Placement stream = sequence_parallel ? Placement(Shard(1)) : Placement(Replicate());
  bool any_dense = false;
  for (const int64_t l : model.model->layer_indices()) {
    if (!model.config().is_sparse_layer(l)) {
      any_dense = true;
      continue;
    }
    plan.add("model.layers." + std::to_string(l) + ".mlp",
             PrepareModuleOutput{.output_layouts = {Partial()}, .desired_output_layouts = {stream}});
  }
  if (!any_dense)
    std::erase_if(plan.entries, [](const auto& e) { return e.first.rfind("model.layers.*.mlp.", 0) == 0; });
  if (model.model->layers->empty())
    std::erase_if(plan.entries, [](const auto& e) { return e.first.rfind("model.layers.", 0) == 0; });
  return plan;
}

namespace {

// Puts parameter `local_name` of `m`, distributed over `mesh` as `placements`, into its slot
// (one built without storage stays without: FSDP allocates its shard).
void distribute_on(Module& m, const std::string& local_name, const DeviceMesh& mesh, const Placements& placements) {
  const Tensor p = m.parameter(local_name);
  Tensor d;
  if (is_deferred(p)) {
    auto spec = std::make_shared<const DistSpec>(mesh, placements, p.shape());
    const Shape local = spec->local_shape();
    d = Tensor::make_distributed(Tensor::from_storage(Storage(), local, contiguous_strides(local), 0, p.dtype()), spec,
                                 p.shape());
  } else {
    NoGradGuard ng;
    d = distribute_tensor(p.detach(), mesh, placements).detach();
  }
  d.set_requires_grad(p.requires_grad());
  d.set_name(p.name());
  m.replace_parameter(local_name, d);
}

// Parameters that the model computes with locally under tensor parallelism (local_view):
// the MoE blocks' (router replicated; routed and shared experts column-parallel for gate/up,
// row-parallel for down, so each rank's output is a partial sum) and Qwen3's q/k norms
// (replicated; each rank normalises its own heads).
void apply_local_tp(LlamaForCausalLM& model, const DeviceMesh& tp, bool experts) {
  for (auto& [name, m] : model.named_modules()) {
    if (auto* a = dynamic_cast<LlamaAttention*>(m); a && a->q_norm) {
      distribute_parameter(*a->q_norm, name + ".q_norm", "weight", tp, Replicate());
      distribute_parameter(*a->k_norm, name + ".k_norm", "weight", tp, Replicate());
    }
    auto* moe = dynamic_cast<MoE*>(m);
    if (!moe) continue;
    distribute_parameter(*moe->gate, name + ".gate", "weight", tp, Replicate());
    if (experts) {
      distribute_parameter(*moe->experts, name + ".experts", "gate_proj", tp, Shard(1));
      distribute_parameter(*moe->experts, name + ".experts", "up_proj", tp, Shard(1));
      distribute_parameter(*moe->experts, name + ".experts", "down_proj", tp, Shard(2));
    }
    if (auto& sh = moe->shared_experts) {
      distribute_parameter(*sh->gate_proj, name + ".shared_experts.gate_proj", "weight", tp, Shard(0));
      distribute_parameter(*sh->up_proj, name + ".shared_experts.up_proj", "weight", tp, Shard(0));
      distribute_parameter(*sh->down_proj, name + ".shared_experts.down_proj", "weight", tp, Shard(1));
    }
  }
}

}  // namespace

void apply_cp(LlamaForCausalLM& model, const DeviceMesh& cp, CpCommType type) {
  const std::shared_ptr<Communicator> comm = cp.comm_ptr(0);
  for (auto& [name, m] : model.named_modules())
    if (auto* a = dynamic_cast<LlamaAttention*>(m))
      a->attention = [comm, type](const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                                  const Tensor& document_ids) {
        return context_parallel_attention(q, k, v, positions, document_ids, comm, type);
      };
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
  // The seed's rule: distributed.moe applies with expert parallelism only.
  const MoeConfig moe_cfg = dc.ep_size > 1 ? dc.moe : MoeConfig{};
  const std::vector<std::pair<std::string, MoE*>> moes = moe_blocks(model);
  std::vector<std::string> experts;
  for (const auto& [name, moe] : moes) experts.push_back(name + ".experts");
  QUILT_CHECK(moes.empty() || dc.strategy != Strategy::kDdp || meshes.size("dp") == 1,
              "[distributed] strategy ddp does not train MoE models over several ranks (the routers' load "
              "balancing and the experts' sharding are fsdp2's); use strategy fsdp2");
  const bool ep_tp = dc.ep_size > 1 && tp.size() > 1;
  if (tp.size() > 1) {
    apply_tp(model, tp, llama_tp_plan_for(model, dc.sequence_parallel, opts.loss_parallel));
    // With ep, the experts are cut over ep and tp at once (below), the rest of the block over tp.
    apply_local_tp(model, tp, /*experts=*/!ep_tp);
  }
  if (ep_tp) {
    // Each rank of an ep group holds E / ep experts, each of them column/row-cut over tp.
    const DeviceMesh ep_tp_mesh = meshes.moe_tp.sub({"ep", "tp"});
    for (const std::string& e : experts) {
      Module& m = model.submodule(e);
      for (const char* w : {"gate_proj", "up_proj", "down_proj"})
        distribute_on(m, w, ep_tp_mesh, {Shard(0), w == std::string("down_proj") ? Shard(2) : Shard(1)});
    }
  }
  // 1b. EP: each MoE block's routed experts split over the ep axis; their hooks carry tokens
  //     to the experts' ranks and back. Like TP, before FSDP, which then shards each rank's
  //     experts over ep_shard.
  if (dc.ep_size > 1) apply_ep(model, meshes["ep"], experts);
  // Aux-loss-free balancing: each router's bias is one value Replicate over every rank that
  // sees different tokens, stepped from their summed counts (update_moe_load_balance).
  for (const auto& [name, moe] : moes) {
    Module& g = *moe->gate;
    if (!g.has_buffer("e_score_correction_bias") || meshes.size("dp_cp") == 1) continue;
    NoGradGuard ng;
    g.replace_buffer("e_score_correction_bias", distribute_tensor(g.buffer("e_score_correction_bias"),
                                                                  meshes["dp_cp"], {Replicate()}));
  }

  // 2. CP: every attention meets the keys of the whole sequence over the cp axis (the batch
  //    layout, each rank's load-balanced chunks, is the train step's).
  if (meshes.size("cp") > 1) apply_cp(model, meshes["cp"], parse_cp_comm_type(dc.cp_comm_type));

  if (dc.activation_checkpointing && !model.model->layers->empty()) {
    apply_ac(model, {.mode = parse_ac_mode(dc.activation_checkpointing_mode), .modules = {"model.layers.*"}});
    // moe.ignore_router_for_ac: the recomputation reuses the forward's choice of experts.
    for (const auto& [name, moe] : moes) moe->gate->keep_choice_for_recompute = moe_cfg.ignore_router_for_ac;
  }

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
  // Expert-parallel experts: their own units over ep_shard (the data-parallel ranks that hold
  // the same experts), nested in their block's unit; the block's other parameters (router,
  // shared experts) stay with the block.
  if (dc.ep_size > 1) {
    FSDPPolicy ep_policy = policy;
    ep_policy.reshard_after_forward = moe_cfg.reshard_after_forward;
    ep_policy.fp32_modules.clear();
    ep_policy.gradient_divide_factor = double(meshes.size("dp_cp"));
    const DeviceMesh ep_shard = ep_tp ? meshes.moe_tp.sub({"ep_shard"}) : meshes["ep_shard"];
    for (const std::string& e : experts) fully_shard(model.submodule(e), ep_shard, ep_policy);
  }
  std::vector<std::string> units;
  if (!model.model->layers->empty()) units.push_back("model.layers.*");
  // moe.wrap_outer_model: the decoder's own embedding and final norm a unit of their own,
  // apart from the head, which the root keeps.
  if (!moes.empty() && moe_cfg.wrap_outer_model) units.push_back("model");
  dp.fsdp = apply_fsdp(model, mesh, policy, units);
  return dp;
}

}  // namespace quilt
