// TrainStep: one optimizer step's worth of forward and backward over the micro-batches a
// data-parallel rank reads, leaving each parameter's .grad averaged over every rank that saw
// different tokens. The trainer calls run(), then clips and steps the optimizer; a pipeline
// schedule is another TrainStep.
//
//   LocalTrainStep step(forward, {.dp = parallelize_llama(...), .loss_comm = meshes["dp_cp"].comm_ptr(0)});
//   double loss = step.run(loader.next_step());   // the global mean loss of the step
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "engine/nn/module.h"
#include "engine/ops/nn.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline/runtime.h"
#include "tools/data.h"

namespace quilt {

/// The loss of a causal language model: mean (or `reduction`) next-token cross entropy of
/// logits (B, T, V) — vocab-sharded logits too, which cross entropy reduces without gathering —
/// against targets (B, T), computed in f32; targets of -100 do not count.
Tensor causal_lm_loss(const Tensor& logits, const Tensor& targets, Reduction reduction = Reduction::mean);

/// Positions 0..T-1 of every sequence of a (B, T) batch, as (B, T) i64.
Tensor default_positions(const Tensor& tokens);

/// Rank `rank` of `cp`'s share of a batch under context parallelism: every row's inputs,
/// targets, positions (0..T-1 when undefined) and documents reordered to the load-balanced
/// layout (parallel/context_parallel.h), per document when the row is packed (documents are the
/// runs of equal document ids). Each row then holds T / cp tokens. Throws naming the document
/// whose length 2·cp does not divide.
Batch context_parallel_batch(const Batch& b, int cp, int rank);

class TrainStep {
 public:
  virtual ~TrainStep() = default;
  /// Forward and backward of every micro-batch (gradients accumulated and synchronised once);
  /// returns the mean loss over micro-batches and data-parallel ranks.
  virtual double run(const std::vector<Batch>& micro_batches) = 0;
  /// The mean loss of the batches without gradients (validation).
  virtual double evaluate(const std::vector<Batch>& micro_batches) = 0;
};

/// What parallelize_* left on a model that a step must drive.
struct StepHooks {
  Device device = Device::cpu();            // the model's: batches are moved there
  DataParallelism dp;                       // FSDP or DDP, if the plan applied one
  bool defer_fsdp_grad_sync = true;         // FSDP: reduce once, at the last micro-batch
  std::shared_ptr<Communicator> loss_comm;  // ranks whose losses are averaged (dp x cp); null: none
  // Context parallelism: the ranks that share each sequence, each of which trains on its
  // context_parallel_batch and weighs its loss sum by the targets the group counts; null: none.
  std::shared_ptr<Communicator> cp_comm;
};

/// A model's forward: tokens (B, T), positions (B, T) and documents ((B, T), or undefined) ->
/// logits (B, T, V).
using LMForward = std::function<Tensor(const Tensor& tokens, const Tensor& positions, const Tensor& document_ids)>;

/// The step of a model that runs whole on this rank (no pipeline): micro-batches in turn.
class LocalTrainStep : public TrainStep {
 public:
  LocalTrainStep(LMForward forward, StepHooks hooks) : forward_(std::move(forward)), hooks_(std::move(hooks)) {}
  double run(const std::vector<Batch>& micro_batches) override;
  double evaluate(const std::vector<Batch>& micro_batches) override;
  /// run() without reading the loss on the host: this rank's mean loss as a 0-d f64 tensor on
  /// the model's device (what a captured CUDA graph step records).
  Tensor run_local(const std::vector<Batch>& micro_batches);

 private:
  Tensor loss_of(const Batch& b);
  double global_mean(const Tensor& local_mean);
  LMForward forward_;
  StepHooks hooks_;
};

/// The step of a pipeline-parallel model: each data-parallel micro-batch is cut into pipeline
/// micro-batches of `rows` sequences and run through this rank's schedule (parallel/pipeline).
/// The loss is the mean over every sequence of the step, as without a pipeline; it is computed
/// on the last stage and shared over the pipeline ranks (`pp_comm`), then averaged like
/// LocalTrainStep's (`loss_comm`). With `scale_in_schedule` the micro-batch losses are not
/// scaled and the schedule divides the gradients by the micro-batch count once, at the end.
struct PipelineStepOptions {
  int64_t rows = 1;  // distributed.pipeline.pp_microbatch_size
  bool scale_in_schedule = false;
  std::shared_ptr<Communicator> pp_comm, loss_comm;
  std::vector<Tensor> params;  // this rank's parameters, for scale_in_schedule
  Device device;               // where the stages run (the micro-batches move there)
};

class PipelineTrainStep : public TrainStep {
 public:
  /// `lists`: every pipeline rank's lowered schedule; `stages`: the stages it puts on this rank.
  PipelineTrainStep(pipeline::Lowered lists, std::vector<pipeline::StageRef> stages, int num_stages,
                    PipelineStepOptions opts);
  double run(const std::vector<Batch>& micro_batches) override;
  double evaluate(const std::vector<Batch>& micro_batches) override;
  pipeline::PipelineRunner& runner() { return *runner_; }

 private:
  std::vector<pipeline::MicroBatch> cut(const Batch& b) const;
  double shared_mean(double local_sum, size_t count);
  std::unique_ptr<pipeline::PipelineRunner> runner_;
  PipelineStepOptions opts_;
  double scale_ = 1;  // of each micro-batch loss in the current step
};

}  // namespace quilt
