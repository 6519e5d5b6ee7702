// Learning-rate schedules: linear warmup, then constant, linear or cosine decay to min_lr,
// as Megatron-LM's OptimizerParamScheduler computes them (and NeMo, which uses it). The
// schedule is a pure function of the step, so its only state is the optimizer's step count:
// restoring the optimizer restores the schedule.
//
//   LRSchedule sched({.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 100, .decay_steps = 1000});
//   for (...) { sched.apply(opt, opt.step_count()); loss.backward(); opt.step(); opt.zero_grad(); }
#pragma once

#include <cstdint>

#include "engine/optim/optimizer.h"

namespace quilt {

enum class LRDecayStyle { constant, linear, cosine };

/// lr_at(step), with step = optimizer steps already taken (0 for the first update):
///   warmup_steps > 0 and step <= warmup_steps:
///       lr = init_lr + (max_lr - init_lr) * step / warmup_steps
///   style constant:          lr = max_lr
///   step >= decay_steps:     lr = min_lr
///   otherwise, with r = (step - warmup_steps) / (decay_steps - warmup_steps):
///       linear:  lr = min_lr + (max_lr - min_lr) * (1 - r)
///       cosine:  lr = min_lr + (max_lr - min_lr) * 0.5 * (1 + cos(pi * r))
/// decay_steps counts from step 0 (warmup included). As in Megatron, the first update uses
/// init_lr (0 by default); torchtitan instead warms up by (step + 1) / (warmup_steps + 1).
class LRSchedule {
 public:
  struct Options {
    double max_lr = 1e-3;
    double min_lr = 0.0;
    double init_lr = 0.0;  // lr at step 0 when warming up
    int64_t warmup_steps = 0;
    int64_t decay_steps = 0;  // ignored by the constant style
    LRDecayStyle style = LRDecayStyle::cosine;
  };
  explicit LRSchedule(Options opts);
  /// The learning rate for the update after `step` updates.
  double lr_at(int64_t step) const;
  /// Sets every group of `opt` to lr_at(step).
  void apply(Optimizer& opt, int64_t step) const;
  const Options& options() const { return opts_; }

 private:
  Options opts_;
};

}  // namespace quilt
