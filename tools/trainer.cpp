// The training loop: see trainer.h. parse (the caller) -> build the run -> resume -> steps
// (micro-batches through the TrainStep, clip, update, log, checkpoint) -> final checkpoint.
#include "tools/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "collectives/agree.h"
#include "collectives/launch.h"
#include "dtensor/grad_norm.h"
#include "tools/checkpointing.h"
#include "tools/metrics.h"
#include "tools/report.h"
#include "tools/run.h"
#include "tools/step_trace.h"

namespace quilt {
namespace fs = std::filesystem;
namespace {

// "validation: step 10  loss: 2.3026", or "loss: nan" (never "-nan").
std::string validation_line(const std::string& what, double loss) {
  char line[96];
  if (std::isnan(loss)) std::snprintf(line, sizeof line, "%s  loss: nan", what.c_str());
  else std::snprintf(line, sizeof line, "%s  loss: %.4f", what.c_str(), loss);
  return line;
}

// Every rank that will write into a directory makes sure it can, before any work: an
// unwritable checkpoint.dir is named at start-up, not at the first save after hours of steps.
void check_writable(const std::string& key, const std::string& dir, int rank) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  QUILT_CHECK(!ec, "[", key, "] cannot create ", dir, ": ", ec.message());
  const fs::path probe = fs::path(dir) / (".quilt-write-probe-" + std::to_string(rank));
  bool ok = bool(std::ofstream(probe) << "probe\n");
  ok = fs::remove(probe, ec) && ok;
  QUILT_CHECK(ok, "[", key, "] ", dir, " is not writable by rank ", rank);
}

// A run that keeps producing non-finite steps stops instead of saving checkpoints of nothing.
void check_skipped(const Run& r) {
  const int64_t limit = r.cfg.train.max_skipped_steps;
  if (limit <= 0 || r.skipped_in_a_row < limit) return;
  // Every rank holds the same loss and norm, so every rank stops here alike.
  throw AgreedError(detail::concat("[train] ", r.skipped_in_a_row, " steps in a row (up to step ", r.step_count,
                                   ") had a non-finite loss or gradient norm and were skipped; stopping "
                                   "(train.max_skipped_steps: ", limit, "). Lower train.lr, check the data, or resume "
                                   "from an earlier checkpoint"),
                    r.world->rank() == 0);
}

// train.cuda_graphs. The process's first kEagerSteps steps run eagerly (the last of them with
// AdamW's staged tables, which it sizes); the next is captured once, and every step from it on
// is a replay of that capture: the batches are copied into the buffers the graph reads, AdamW's
// step counts and lr are staged, and the loss, norm and skip flag are read once after it. All of
// it runs on one stream of the GPU, current on this thread for the whole run.
struct GraphedStep {
  static constexpr int64_t kEagerSteps = 2;
  explicit GraphedStep(Device d) : stream(new_stream(d)), guard(stream) {
    skip = zeros({}, {.dtype = DType::b8, .device = d});
  }
  Stream stream;
  StreamGuard guard;
  cuda::Graph graph;
  std::vector<Batch> batches;  // device buffers the graph reads
  Tensor loss, norm, skip;     // what it writes: the step's mean loss and norm, and "not finite"
  int64_t eager_steps = 0;
};

// Copies this step's host micro-batches into the graph's buffers (made at the first call).
void stage_batches(GraphedStep& g, const std::vector<Batch>& host, Device device) {
  auto fill = [&](Tensor& dst, const Tensor& src, const char* what, size_t m) {
    if (!dst.defined()) dst = Tensor::empty(src.shape(), {.dtype = src.dtype(), .device = device});
    QUILT_CHECK(dst.shape() == src.shape() && dst.dtype() == src.dtype(), "[train.cuda_graphs] micro-batch ", m,
                "'s ", what, " is ", dtype_name(src.dtype()), " ", src.shape(), " but the captured step reads ",
                dtype_name(dst.dtype()), " ", dst.shape(), ": a captured step needs batches of one shape");
    dst.copy_(src);
  };
  const bool first = g.batches.empty();
  if (first) g.batches.resize(host.size());
  QUILT_CHECK(host.size() == g.batches.size(), "[train.cuda_graphs] this step has ", host.size(),
              " micro-batches, the captured one ", g.batches.size());
  for (size_t m = 0; m < host.size(); ++m) {
    const Batch& h = host[m];
    Batch& d = g.batches[m];
    QUILT_CHECK(first || h.document_ids.defined() == d.document_ids.defined(), "[train.cuda_graphs] micro-batch ", m,
                h.document_ids.defined() ? " has" : " has no", " document ids, unlike the captured step's");
    fill(d.inputs, h.inputs, "inputs", m);
    fill(d.targets, h.targets, "targets", m);
    fill(d.positions, h.positions.defined() ? h.positions : default_positions(h.inputs), "positions", m);
    if (h.document_ids.defined()) fill(d.document_ids, h.document_ids, "document ids", m);
  }
}

// One replayed step (captured first, at its first call): the graphed counterpart of the eager
// step's forward, backward, clipping and update.
void graphed_step(Run& r, GraphedStep& g, StepMetrics& m) {
  {
    trace::Scope scope("data", "load batches");
    stage_batches(g, r.loader->next_step(), r.device);
  }
  if (!g.graph.captured()) {
    auto* local = dynamic_cast<LocalTrainStep*>(r.step.get());
    QUILT_CHECK(local != nullptr, "[train.cuda_graphs] captures the step of a model that runs whole on one GPU");
    r.opt->zero_grad();  // the captured backward makes every gradient afresh
    // What the capture allocates comes from a private pool that cannot reuse the blocks the
    // eager steps left cached: hand those back first, or the working set is held twice.
    synchronize(g.stream);
    cuda::empty_cache(r.device.index);
    g.graph.capture_begin(g.stream);
    g.loss = local->run_local(g.batches);
    g.norm = dtensor::clip_grad_norm_(r.params, r.cfg.train.max_grad_norm.value_or(INFINITY), 2.0, nullptr);
    g.skip.copy_(logical_not(logical_and(isfinite(g.loss), isfinite(g.norm))));
    r.opt->step();
    g.graph.capture_end();
    log_line("train.cuda_graphs: step ", r.step_count + 1, " captured; every step from here replays it");
  } else {
    r.opt->stage_replay();
  }
  {
    trace::Scope scope("step", "graph replay");
    g.graph.replay(g.stream);
    m.loss = g.loss.item<double>();
  }
  m.grad_norm = g.norm.item<double>();
  m.skipped = g.skip.item<double>() != 0;
  if (m.skipped) {
    r.opt->unstep();
    log_line("step ", r.step_count + 1, ": non-finite ", std::isfinite(m.loss) ? "gradient norm" : "loss",
             ", the update was skipped on the device");
  }
}

double validation_loss(Run& r) {
  if (!r.val_loader) return -1;
  for (const auto& m : r.stages) m->eval();
  r.val_loader->reset();
  double total = 0;
  const int64_t n = std::max<int64_t>(1, r.cfg.train.eval_steps);
  for (int64_t s = 0; s < n; ++s) total += r.step->evaluate(r.val_loader->next_step());
  for (const auto& m : r.stages) m->train();
  return total / double(n);
}

// Forward and backward of the step's micro-batches, clipping, and the update unless the loss or
// norm is not finite.
void eager_step(Run& r, StepMetrics& m, PipelineTrainStep* pipe, bool tracing) {
  std::vector<Batch> batches;
  {
    trace::Scope scope("data", "load batches");
    batches = r.loader->next_step();
    scope.arg("micro-batches", int64_t(batches.size()));
  }
  for (const auto& s : r.stages) set_moe_aux_loss_scale(*s, 1.0 / double(std::max<size_t>(1, batches.size())));
  {
    trace::Scope scope("step", "forward + backward");
    m.loss = r.step->run(batches);
  }
  if (tracing && pipe) pipe->runner().set_tracing(false);
  {
    trace::Scope scope("optimizer", "clip grad norm");
    m.grad_norm = dtensor::clip_grad_norm_(r.params, r.cfg.train.max_grad_norm.value_or(INFINITY), 2.0, r.pp_comm.get())
                      .item<double>();
  }
  m.skipped = !(std::isfinite(m.loss) && std::isfinite(m.grad_norm));
  if (!m.skipped) {
    trace::Scope scope("optimizer", "optimizer step");
    r.opt->step();
  } else log_line("step ", r.step_count + 1, ": non-finite ", std::isfinite(m.loss) ? "gradient norm" : "loss", ", step skipped on every rank");
}

// One optimizer step; a non-finite loss or norm skips the update on every rank alike (every
// rank holds the same averaged loss and gradient norm).
StepMetrics train_step(Run& r, GraphedStep* graphed) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool on_gpu = !r.device.is_cpu();
  reset_cpu_peak_memory();
  if (on_gpu) cuda::reset_peak_memory(r.device.index);
  StepMetrics m;
  m.lr = r.sched->lr_at(r.opt->step_count());
  r.opt->set_lr(m.lr);
  const double waited = r.dp.fsdp ? r.dp.fsdp->all_gather_wait_seconds() : 0;
  // logging.trace: this step's ops, collectives, FSDP traffic, data and optimizer as slices
  // (and the pipeline's actions under pp), timed from a barrier so the ranks line up.
  const LoggingConfig& lg = r.cfg.logging;
  auto* pipe = dynamic_cast<PipelineTrainStep*>(r.step.get());
  const bool tracing = lg.trace && std::count(lg.trace_steps.begin(), lg.trace_steps.end(), r.step_count + 1) > 0;
  if (tracing) {
    r.world->barrier();
    trace::take();
    trace::reset_origin();
    trace::set_enabled(true);
    if (pipe) pipe->runner().set_tracing(true);
  }
  if (graphed && graphed->eager_steps >= GraphedStep::kEagerSteps) {
    graphed_step(r, *graphed, m);
  } else {
    // The last eager step sizes the optimizer's staged tables: it counts once it has updated.
    if (graphed && graphed->eager_steps == GraphedStep::kEagerSteps - 1) r.opt->prepare_graph_steps(graphed->skip);
    eager_step(r, m, pipe, tracing);
    if (graphed && !m.skipped) ++graphed->eager_steps;
  }
  if (r.dp.fsdp) m.gather_wait_s = r.dp.fsdp->all_gather_wait_seconds() - waited;
  r.skipped_in_a_row = m.skipped ? r.skipped_in_a_row + 1 : 0;
  if (!graphed || !graphed->graph.captured()) {  // a replay overwrites the gradients it made
    trace::Scope scope("optimizer", "zero grad");
    r.opt->zero_grad();
  }
  if (tracing) {
    trace::set_enabled(false);
    write_step_trace(r, r.step_count + 1, trace::take(), pipe ? &pipe->runner().trace() : nullptr);
  }
  // Aux-loss-free balancing: once per optimizer step, from the step's global expert load.
  for (const auto& s : r.stages) m.moe_load = std::max(m.moe_load, update_moe_load_balance(*s));
  m.step = ++r.step_count;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = double(r.cfg.train.global_batch_size * r.cfg.train.seq_len);
  m.tps = tokens / secs;
  m.tflops = r.flops_per_token * tokens / double(r.world->size()) / secs / 1e12;
  m.mfu = m.tflops / peak_tflops_per_rank(r.device, r.cfg.train.param_dtype.value_or(r.cfg.train.dtype));
  const MemoryStats mem = on_gpu ? cuda::memory_stats(r.device.index) : cpu_memory_stats();
  // A replayed step allocates nothing: its working set is the graph's pool, held as reserved.
  const bool replayed = graphed && graphed->graph.captured();
  m.memory_gib = double(replayed ? mem.reserved : mem.peak_allocated) / double(int64_t(1) << 30);
  return m;
}

}  // namespace

TrainResult train(const RecipeConfig& cfg, int64_t stop_after) {
  const CheckpointConfig& ck = cfg.checkpoint;
  agree(world(), "start-up checks", [&] {
    const int rank = world().rank();
    if (ck.dir) check_writable("checkpoint.dir", *ck.dir, rank);  // every rank writes its shard
    if (cfg.logging.dir && rank == 0) check_writable("logging.dir", *cfg.logging.dir, rank);
  });
  std::unique_ptr<Run> run = build_run(cfg);
  Run& r = *run;
  log_startup_report(r);
  {
    const DType compute = cfg.train.param_dtype.value_or(cfg.train.dtype);
    char peak[32];
    std::snprintf(peak, sizeof peak, "%.3f", peak_tflops_per_rank(r.device, compute));
    log_line("mfu: against ", peak, " TFLOP/s per rank (",
             std::getenv("QUILT_PEAK_TFLOPS") ? "QUILT_PEAK_TFLOPS"
             : r.device.is_cpu() ? std::string("a 1024^3 ") + dtype_name(compute == DType::bf16 ? compute : DType::f32) +
                                       " GEMM timed here on this rank's threads"
                                 : std::string("a Hopper's dense bf16 peak"),
             ")");
  }
  if (ck.dir) {
    std::string from;
    if (ck.resume.kind == ResumeSpec::Kind::kAuto) from = latest_checkpoint(*ck.dir);
    if (ck.resume.kind == ResumeSpec::Kind::kPath) from = ck.resume.path;
    if (!from.empty()) load_checkpoint(r, from);
  }
  std::optional<MetricsLog> metrics;
  agree(*r.world, "opening logging.dir", [&] { metrics.emplace(cfg.logging, r.world->rank()); });
  TrainResult result;
  for (const auto& s : r.stages) s->train();
  const int64_t last = stop_after >= 0 ? std::min(stop_after, cfg.train.steps) : cfg.train.steps;
  const auto started = std::chrono::steady_clock::now();
  const int64_t first = r.step_count;
  std::optional<GraphedStep> graphed;
  if (cfg.train.cuda_graphs) graphed.emplace(r.device);
  while (r.step_count < last) {
    StepMetrics m = train_step(r, graphed ? &*graphed : nullptr);
    // Elapsed time and ETA at this run's mean step time (a resumed run counts from its resume).
    m.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    m.eta_s = m.elapsed_s / double(m.step - first) * double(last - m.step);
    result.steps.push_back(m);
    metrics->step(m, m.step % std::max<int64_t>(1, cfg.logging.every_steps) == 0 || m.step == 1 || m.step == last);
    check_skipped(r);
    if (cfg.train.eval_every > 0 && m.step % cfg.train.eval_every == 0 && r.val_loader)
      log_line(validation_line("validation: step " + std::to_string(m.step), validation_loss(r)));
    if (ck.dir && ck.every_steps > 0 && m.step % ck.every_steps == 0 && m.step < last) save_checkpoint(r, *ck.dir);
  }
  // The last state is saved (and exported) — also with train.steps 0, which exports the
  // initial (e.g. pretrained) weights at once.
  if (ck.dir && (!result.steps.empty() || (cfg.train.steps == 0 && ck.save_consolidated))) {
    save_checkpoint(r, *ck.dir);
    if (ck.save_consolidated) export_consolidated(r, *ck.dir);
  }
  result.final_val_loss = validation_loss(r);
  if (r.val_loader) log_line(validation_line("validation: final, step " + std::to_string(r.step_count), result.final_val_loss));
  return result;
}

double evaluate(const RecipeConfig& cfg, const std::string& checkpoint_dir) {
  QUILT_CHECK(fs::is_directory(checkpoint_dir), "[eval] --checkpoint ", checkpoint_dir,
              fs::exists(checkpoint_dir) ? " is not a directory (give a step_N checkpoint directory)" : " does not exist");
  std::unique_ptr<Run> run = build_run(cfg);
  load_checkpoint(*run, checkpoint_dir);
  QUILT_CHECK(run->val_loader != nullptr, "[eval] the recipe has no data.val_path");
  return validation_loss(*run);
}

}  // namespace quilt
