// Everything one training run holds, built from a recipe in build order: meshes, model
// (random or pretrained weights), its parallelize plan, optimizer and schedule, data, the
// train step. The trainer, evaluation and checkpointing share it.
//
//   std::unique_ptr<Run> r = build_run(cfg);    // every rank, collective
//   double loss = r->step->run(r->loader->next_step());
#pragma once

#include <memory>
#include <vector>

#include "engine/engine.h"
#include "models/llama/llama.h"
#include "parallel/data_parallel.h"
#include "parallel/parallel_dims.h"
#include "tools/config.h"
#include "tools/data.h"
#include "tools/train_step.h"

namespace quilt {

/// The LlamaConfig of a recipe's model: section (validated).
LlamaConfig llama_config(const ModelConfig& m);

struct Run {
  RecipeConfig cfg;
  ParallelDims dims;
  std::shared_ptr<Communicator> world;
  Meshes meshes;
  std::shared_ptr<LlamaForCausalLM> model;  // stages[0]
  std::vector<std::shared_ptr<LlamaForCausalLM>> stages;  // the whole model, or this rank's pipeline stages
  std::shared_ptr<Communicator> pp_comm;   // pipeline ranks (pp > 1)
  double flops_per_token = 0;              // of the whole model, forward + backward
  DataParallelism dp;
  std::unique_ptr<TrainStep> step;
  std::vector<Tensor> params;  // what the optimizer updates (sharded under FSDP)
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<LRSchedule> sched;
  std::unique_ptr<DataLoader> loader, val_loader;
  int64_t step_count = 0;  // optimizer steps completed
  int64_t skipped_in_a_row = 0;  // consecutive steps skipped for a non-finite loss or norm
  Device device = Device::cpu();  // where the model, its optimizer state and the batches live

  Run(const RecipeConfig& c, int64_t world_size);
};

/// Builds the run of `cfg` on the world communicator (init_from_launcher must have run).
std::unique_ptr<Run> build_run(const RecipeConfig& cfg);

}  // namespace quilt
