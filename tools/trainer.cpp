// The training loop: see trainer.h. parse (the caller) -> build the run -> resume -> steps
// (micro-batches through the TrainStep, clip, update, log, checkpoint) -> final checkpoint.
#include "tools/trainer.h"

#include <chrono>
#include <cmath>

#include "collectives/launch.h"
#include "dtensor/grad_norm.h"
#include "tools/checkpointing.h"
#include "tools/metrics.h"
#include "tools/run.h"

namespace quilt {
namespace {

double validation_loss(Run& r) {
  if (!r.val_loader) return -1;
  r.model->eval();
  r.val_loader->reset();
  double total = 0;
  const int64_t n = std::max<int64_t>(1, r.cfg.train.eval_steps);
  for (int64_t s = 0; s < n; ++s) total += r.step->evaluate(r.val_loader->next_step());
  r.model->train();
  return total / double(n);
}

// One optimizer step; a non-finite loss or norm skips the update on every rank alike (every
// rank holds the same averaged loss and gradient norm).
StepMetrics train_step(Run& r) {
  const auto t0 = std::chrono::steady_clock::now();
  reset_cpu_peak_memory();
  StepMetrics m;
  m.lr = r.sched->lr_at(r.opt->step_count());
  r.opt->set_lr(m.lr);
  const double waited = r.dp.fsdp ? r.dp.fsdp->all_gather_wait_seconds() : 0;
  const std::vector<Batch> batches = r.loader->next_step();
  set_moe_aux_loss_scale(*r.model, 1.0 / double(std::max<size_t>(1, batches.size())));
  m.loss = r.step->run(batches);
  if (r.dp.fsdp) m.gather_wait_s = r.dp.fsdp->all_gather_wait_seconds() - waited;
  m.grad_norm = dtensor::clip_grad_norm_(r.params, r.cfg.train.max_grad_norm.value_or(INFINITY)).item<double>();
  m.skipped = !(std::isfinite(m.loss) && std::isfinite(m.grad_norm));
  if (!m.skipped) r.opt->step();
  else log_line("step ", r.step_count + 1, ": non-finite ", std::isfinite(m.loss) ? "gradient norm" : "loss", ", step skipped on every rank");
  r.opt->zero_grad();
  // Aux-loss-free balancing: once per optimizer step, from the step's global expert load.
  m.moe_load = update_moe_load_balance(*r.model);
  m.step = ++r.step_count;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = double(r.cfg.train.global_batch_size * r.cfg.train.seq_len);
  m.tps = tokens / secs;
  m.tflops = r.model->flops_per_token(r.cfg.train.seq_len) * tokens / double(r.world->size()) / secs / 1e12;
  m.mfu = m.tflops / peak_tflops_per_rank();
  m.memory_gib = double(cpu_memory_stats().peak_allocated) / double(int64_t(1) << 30);
  return m;
}

}  // namespace

TrainResult train(const RecipeConfig& cfg, int64_t stop_after) {
  std::unique_ptr<Run> run = build_run(cfg);
  Run& r = *run;
  const CheckpointConfig& ck = cfg.checkpoint;
  if (ck.dir) {
    std::string from;
    if (ck.resume.kind == ResumeSpec::Kind::kAuto) from = latest_checkpoint(*ck.dir);
    if (ck.resume.kind == ResumeSpec::Kind::kPath) from = ck.resume.path;
    if (!from.empty()) load_checkpoint(r, from);
  }
  MetricsLog metrics(cfg.logging, r.world->rank());
  TrainResult result;
  r.model->train();
  const int64_t last = stop_after >= 0 ? std::min(stop_after, cfg.train.steps) : cfg.train.steps;
  while (r.step_count < last) {
    StepMetrics m = train_step(r);
    result.steps.push_back(m);
    metrics.step(m, m.step % std::max<int64_t>(1, cfg.logging.every_steps) == 0 || m.step == 1 || m.step == last);
    if (cfg.train.eval_every > 0 && m.step % cfg.train.eval_every == 0 && r.val_loader) {
      char line[96];
      std::snprintf(line, sizeof line, "validation: step %lld  loss: %.4f", static_cast<long long>(m.step), validation_loss(r));
      log_line(line);
    }
    if (ck.dir && ck.every_steps > 0 && m.step % ck.every_steps == 0 && m.step < last) save_checkpoint(r, *ck.dir);
  }
  // The last state is saved (and exported) — also with train.steps 0, which exports the
  // initial (e.g. pretrained) weights at once.
  if (ck.dir && (!result.steps.empty() || (cfg.train.steps == 0 && ck.save_consolidated))) {
    save_checkpoint(r, *ck.dir);
    if (ck.save_consolidated) export_consolidated(r, *ck.dir);
  }
  result.final_val_loss = validation_loss(r);
  if (result.final_val_loss >= 0) log_line("validation loss: ", result.final_val_loss);
  return result;
}

double evaluate(const RecipeConfig& cfg, const std::string& checkpoint_dir) {
  std::unique_ptr<Run> run = build_run(cfg);
  load_checkpoint(*run, checkpoint_dir);
  QUILT_CHECK(run->val_loader != nullptr, "[eval] the recipe has no data.val_path");
  return validation_loss(*run);
}

}  // namespace quilt
