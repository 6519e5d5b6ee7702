// LR schedule: the Megatron/NeMo warmup + decay formula, validated at construction.
#include "engine/optim/lr_schedule.h"

#include <cmath>
#include <numbers>

namespace quilt {

LRSchedule::LRSchedule(Options o) : opts_(o) {
  QUILT_CHECK(o.max_lr >= 0 && o.min_lr >= 0 && o.init_lr >= 0, "[lr_schedule] learning rates must be >= 0, got max_lr ",
              o.max_lr, ", min_lr ", o.min_lr, ", init_lr ", o.init_lr);
  QUILT_CHECK(o.min_lr <= o.max_lr, "[lr_schedule] min_lr ", o.min_lr, " exceeds max_lr ", o.max_lr);
  QUILT_CHECK(o.warmup_steps >= 0, "[lr_schedule] warmup_steps must be >= 0, got ", o.warmup_steps);
  QUILT_CHECK(o.style == LRDecayStyle::constant || o.decay_steps > o.warmup_steps,
              "[lr_schedule] decay_steps (", o.decay_steps, ") must exceed warmup_steps (", o.warmup_steps, ")");
}

double LRSchedule::lr_at(int64_t step) const {
  QUILT_CHECK(step >= 0, "[lr_schedule] step must be >= 0, got ", step);
  const Options& o = opts_;
  if (o.warmup_steps > 0 && step <= o.warmup_steps)
    return o.init_lr + (o.max_lr - o.init_lr) * double(step) / double(o.warmup_steps);
  if (o.style == LRDecayStyle::constant) return o.max_lr;
  if (step >= o.decay_steps) return o.min_lr;
  const double r = double(step - o.warmup_steps) / double(o.decay_steps - o.warmup_steps);
  const double coeff = o.style == LRDecayStyle::linear ? 1.0 - r : 0.5 * (1.0 + std::cos(std::numbers::pi * r));
  return o.min_lr + (o.max_lr - o.min_lr) * coeff;
}

void LRSchedule::apply(Optimizer& opt, int64_t step) const { opt.set_lr(lr_at(step)); }

}  // namespace quilt
