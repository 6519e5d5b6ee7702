// Activation checkpointing by wrapping modules: see activation_checkpoint.h.
#include "parallel/activation_checkpoint.h"

#include "parallel/module_names.h"

namespace quilt {

ACMode parse_ac_mode(const std::string& name) {
  if (name == "full") return ACMode::full;
  if (name == "selective") return ACMode::selective;
  fail("[distributed] activation_checkpointing_mode '", name, "' is not one of full, selective");
}

void apply_ac(Module& root, const ACConfig& cfg) {
  std::vector<Module*> targets;
  for (const std::string& pattern : cfg.modules) {
    const std::vector<std::string> names = match_modules(root, pattern);
    QUILT_CHECK(!names.empty(), "[apply_ac] pattern '", pattern, "' matches no module of this ", root.type_name());
    for (const std::string& n : names) {
      Module& m = root.submodule(n);
      QUILT_CHECK(!m.has_forward_wrapper(), "[apply_ac] '", n, "' (", m.type_name(),
                  ") already has a forward wrapper: checkpoint a module once");
      targets.push_back(&m);
    }
  }
  const CheckpointMode mode = cfg.mode == ACMode::selective ? CheckpointMode::save_matmuls : CheckpointMode::full;
  Generator* gen = cfg.generator;
  for (Module* m : targets)
    // The body is copied into the checkpoint: the recomputation in backward outlives this call.
    m->set_forward_wrapper([mode, gen](const std::vector<Tensor>& inputs, const ForwardBody& body) {
      return checkpoint(CheckpointFn(body), inputs, gen, mode);
    });
}

}  // namespace quilt
