// The training loop behind `quilt train` and `quilt eval`: builds the model of a recipe,
// applies its parallel layout, and runs steps with gradient accumulation, LR schedule,
// clipping, non-finite skipping, step lines + metrics.jsonl, and atomic checkpoints.
//
//   RecipeConfig cfg = load_recipe("recipes/llama_tiny.yaml", {"train.steps=20"});
//   TrainResult r = train(cfg);          // under mpirun: every rank calls it
#pragma once

#include <string>
#include <vector>

#include "tools/config.h"

namespace quilt {

/// Per-step figures (the same ones the step line prints).
struct StepMetrics {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, lr = 0, tps = 0, tflops = 0, mfu = 0, memory_gib = 0;
  double gather_wait_s = -1;  // time this rank waited on FSDP all-gathers in the step (< 0: no FSDP)
  double moe_load = 0;        // busiest expert's tokens / the mean, worst over MoE layers (0: no balancing)
  double elapsed_s = -1;      // since this run's first step began (< 0: not known)
  double eta_s = -1;          // to train.steps (or --stop-after) at this run's mean step time
  bool skipped = false;
};

struct TrainResult {
  std::vector<StepMetrics> steps;  // every step run in this call (resumed runs: from the resume point)
  double final_val_loss = -1;      // < 0: no validation data
};

/// Trains per the recipe on the world communicator (init_from_launcher must have run).
/// `stop_after` >= 0 ends the run (with a checkpoint when checkpoint.dir is set) once that many
/// steps are complete, as a stopped job would; the schedule still spans train.steps.
TrainResult train(const RecipeConfig& cfg, int64_t stop_after = -1);
/// Loads a checkpoint directory and returns the validation loss over eval_steps batches.
double evaluate(const RecipeConfig& cfg, const std::string& checkpoint_dir);
/// Newest complete checkpoint (step_N directory) under `dir`, or "" when there is none.
std::string latest_checkpoint(const std::string& dir);

}  // namespace quilt
