// How a Llama becomes a parallel program: the model's tensor-parallel plan, its fp32 islands,
// and parallelize_llama(), which applies the parallelisms in torchtitan's order
// (apply_tp -> apply_cp -> apply_ac -> apply_fsdp | apply_ddp).
//
//   ParallelDims dims(cfg.distributed, world->size());
//   Meshes meshes = dims.build_meshes(world);
//   auto model = std::make_shared<LlamaForCausalLM>(llama_cfg);
//   model->init_weights(seed);
//   parallelize_llama(*model, meshes, cfg.distributed);
//   Tensor logits = (*model)(tokens, positions);   // vocab-sharded on tp under loss parallelism
#pragma once

#include <string>
#include <vector>

#include "models/llama/llama.h"
#include "parallel/activation_checkpoint.h"
#include "parallel/context_parallel.h"
#include "parallel/data_parallel.h"
#include "parallel/parallel_dims.h"
#include "parallel/tensor_parallel.h"

namespace quilt {

/// torchtitan's Llama plan over the tp axis: the embedding row-parallel over the vocabulary,
/// q/k/v/gate/up column-parallel, o/down row-parallel (their partial sums all-reduced, or
/// reduce-scattered onto the sequence under sequence parallelism), the attention and MLP
/// inputs laid out once per block, the norms sequence-parallel under SP, and lm_head
/// column-parallel over the vocabulary: with `loss_parallel` its logits stay distributed,
/// Shard(-1) on tp, for a cross entropy that never gathers them; without, they are gathered.
/// For the whole, untied model (llama_tp_plan_for fits it to a stage or tied embeddings).
TensorParallelPlan llama_tp_plan(bool sequence_parallel, bool loss_parallel);

/// llama_tp_plan for `model` as built: entries for an embedding, norm or head the stage does
/// not hold are dropped, and tied embeddings compute the logits from the vocab-parallel
/// embedding (gathered at the root unless `loss_parallel`).
TensorParallelPlan llama_tp_plan_for(const LlamaForCausalLM& model, bool sequence_parallel, bool loss_parallel);

/// Context parallelism: every attention of `model` attends over the sequence its tokens share
/// with the ranks of the 1-D mesh `cp` (context_parallel_attention, exchanging K/V by `type`).
/// The tokens each rank feeds the model are then its load-balanced chunks with their global
/// positions (context_parallel_batch in tools/train_step.h).
void apply_cp(LlamaForCausalLM& model, const DeviceMesh& cp, CpCommType type);

/// Dotted-name suffixes of the modules that stay in f32 under mixed precision (their own FSDP
/// units with f32 parameters and reductions): the norms.
const std::vector<std::string>& llama_fp32_modules();

/// What parallelize_llama needs beyond the distributed: section.
struct LlamaParallelizeOptions {
  /// Keep the logits vocab-sharded over tp for the loss (tp > 1).
  bool loss_parallel = true;
  /// Mixed precision (FSDP's policy; DDP casts parameters per forward and reduces in f32):
  /// compute dtype of parameters, dtype of gradient reductions, dtype of unit outputs.
  std::optional<DType> param_dtype, reduce_dtype, output_dtype;
};

/// Applies the parallelisms `dc` asks for to `model` (weights already initialised or loaded:
/// they must agree on every rank), over `meshes` from ParallelDims::build_meshes, and returns
/// the data parallelism a train step drives.
DataParallelism parallelize_llama(LlamaForCausalLM& model, const Meshes& meshes, const DistributedConfig& dc,
                       const LlamaParallelizeOptions& opts = {});

}  // namespace quilt
