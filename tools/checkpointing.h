// The trainer's checkpoints: every N steps through the resharding distributed checkpoint
// (model tensors as "model.<name>", optimizer tensors as "optim.<key>", the optimizer's
// scalars and the trainer's own state in the index metadata), keep_last pruning, resume into
// any layout, and the consolidated HF export (model.safetensors + config.json).
//
//   save_checkpoint(run, "ckpt");            // ckpt/step_00000100, atomically
//   load_checkpoint(run, latest_checkpoint("ckpt"));
#pragma once

#include <string>

#include "tools/run.h"

namespace quilt {

/// "step_00000042".
std::string step_dir_name(int64_t step);
/// Writes `root`/step_N for the run's current step (collective); prunes to keep_last.
void save_checkpoint(Run& r, const std::string& root);
/// Loads a step_N directory into the run's model, optimizer, loader and step (any layout).
void load_checkpoint(Run& r, const std::string& dir);
/// Writes `root`/hf/{model.safetensors, config.json} from the checkpoint of the current step (rank 0).
void export_consolidated(Run& r, const std::string& root);
/// Newest complete checkpoint (step_N directory) under `dir`, or "" when there is none.
std::string latest_checkpoint(const std::string& dir);

}  // namespace quilt
