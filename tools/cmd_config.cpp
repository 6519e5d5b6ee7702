// `quilt config check`: validates a recipe (with --set overrides) for a world size and prints
// the effective recipe and the mesh line, so a bad recipe fails here, naming the key, before
// any rank starts work.
#include <cstdio>

#include "tools/command.h"
#include "tools/config.h"

namespace quilt {
namespace {

int config_check(const CommandArgs& a) {
  RecipeConfig cfg = load_recipe(a.get("--config"), a.list("--set"));
  const bool inferred = !a.has("--world");
  const int64_t world = inferred ? default_world_size(cfg) : a.get_int("--world");
  ParallelDims dims = check_recipe(cfg, world);
  const TrainConfig& t = cfg.train;
  std::printf("# effective recipe: %s\n%s", cfg.source.c_str(), recipe_to_yaml(cfg).c_str());
  std::printf("# model: %s, %.3fM parameters\n", cfg.model.model_type.c_str(), cfg.model.num_parameters() / 1e6);
  std::printf("# batch: global %lld = micro %lld x dp %lld x accumulation %lld, %lld tokens per step\n",
              static_cast<long long>(t.global_batch_size), static_cast<long long>(t.micro_batch_size),
              static_cast<long long>(dims.dp()), static_cast<long long>(t.accumulation_steps(dims.dp())),
              static_cast<long long>(t.global_batch_size * t.seq_len));
  std::printf("%s%s\n", dims.mesh_string().c_str(), inferred ? "  (world inferred; pass --world N)" : "");
  return 0;
}

CommandRegistrar reg({
    .path = {"config", "check"},
    .help = "Validate a recipe for a world size; print the effective recipe and the mesh",
    .options = {{.name = "-c,--config", .help = "recipe YAML file", .required = true},
                {.name = "--set", .help = "override key=value (e.g. train.steps=20); repeatable",
                 .kind = OptionKind::kList},
                {.name = "-w,--world", .help = "world size (default: the smallest the recipe allows)"}},
    .run = config_check,
});

}  // namespace
}  // namespace quilt
