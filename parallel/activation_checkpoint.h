// Activation checkpointing by wrapping modules: each module a pattern names (the decoder
// layers) runs its forward body through engine/checkpoint.h, inside its own hooks, so only
// the module's inputs (and, selectively, its matmul outputs) are kept for backward.
//
//   apply_ac(*model, {.mode = ACMode::selective, .modules = {"model.layers.*"}});
//
// The wrapper sits between the module's pre- and post-forward hooks: hooks that gather
// parameters (FSDP) run once around the region, and a recomputation re-runs only the body,
// reading the parameters through their slots as they are at backward time.
#pragma once

#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "engine/nn/module.h"

namespace quilt {

/// What a checkpointed module keeps from its first forward.
enum class ACMode {
  full,       // only its inputs: the whole body is recomputed in backward
  selective,  // also every linear() output: only the cheap ops between matmuls are recomputed
};

/// "full" or "selective"; throws naming distributed.activation_checkpointing_mode otherwise.
ACMode parse_ac_mode(const std::string& name);

struct ACConfig {
  ACMode mode = ACMode::full;
  /// Patterns of the modules to wrap ("*" for one name component, as in match_modules).
  std::vector<std::string> modules;
  /// The generator dropout inside the regions draws from (null: the thread's default).
  Generator* generator = nullptr;
};

/// Wraps every module that `cfg.modules` names in checkpointing. Throws naming a pattern that
/// matches no module, or a module that already has a forward wrapper.
void apply_ac(Module& root, const ACConfig& cfg);

}  // namespace quilt
