// `quilt train --config FILE [--set key=value ...]`: validates the recipe on every rank before
// any work (a bad recipe exits non-zero naming the key), then runs the training loop.
#include <cmath>

#include "collectives/launch.h"
#include "tools/command.h"
#include "tools/config.h"
#include "tools/trainer.h"

namespace quilt {
namespace {

int train_main(const CommandArgs& a) {
  RecipeConfig cfg = load_recipe(a.get("--config"), a.list("--set"));
  init_from_launcher(trainer_launch_options(cfg));
  (void)check_recipe(cfg, world().size());
  train(cfg, a.has("--stop-after") ? a.get_int("--stop-after") : -1);
  finalize();
  return 0;
}

int eval_main(const CommandArgs& a) {
  RecipeConfig cfg = load_recipe(a.get("--config"), a.list("--set"));
  init_from_launcher(trainer_launch_options(cfg));
  (void)check_recipe(cfg, world().size());
  const double loss = evaluate(cfg, a.get("--checkpoint"));
  if (std::isnan(loss)) log_line("validation loss: nan");
  else log_line("validation loss: ", loss);
  finalize();
  return 0;
}

CommandRegistrar train_reg({
    .path = {"train"},
    .help = "Train the recipe's model (launch under mpirun/srun for several ranks)",
    .options = {{.name = "-c,--config", .help = "recipe YAML file", .required = true},
                {.name = "--set", .help = "override key=value (e.g. train.steps=20); repeatable", .kind = OptionKind::kList},
                {.name = "--stop-after", .help = "end the run after N steps (checkpointing), keeping the schedule of train.steps"}},
    .run = train_main,
});

CommandRegistrar eval_reg({
    .path = {"eval"},
    .help = "Print the validation loss of a checkpoint",
    .options = {{.name = "-c,--config", .help = "recipe YAML file", .required = true},
                {.name = "--checkpoint", .help = "checkpoint directory (step_N)", .required = true},
                {.name = "--set", .help = "override key=value; repeatable", .kind = OptionKind::kList}},
    .run = eval_main,
});

}  // namespace
}  // namespace quilt
