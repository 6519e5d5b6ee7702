// The training loop: see trainer.h. Reads as: set up (mesh, model, layout, optimizer, data,
// resume) -> steps (micro-batches, reduce, clip, update, log, checkpoint) -> final checkpoint.
#include "tools/trainer.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "collectives/launch.h"
#include "engine/engine.h"
#include "kernels/cpu/matmul.h"
#include "models/llama/llama.h"
#include "dtensor/checkpoint.h"
#include "dtensor/dtensor.h"
#include "dtensor/grad_norm.h"
#include "parallel/replicate.h"
#include "parallel/fsdp.h"
#include "parallel/mixed_precision.h"
#include "parallel/parallel_dims.h"
#include "tools/data.h"

namespace quilt {
namespace fs = std::filesystem;
namespace {

LlamaConfig llama_config(const ModelConfig& m) {
  LlamaConfig c;
  c.hidden_size = m.hidden_size;
  c.intermediate_size = m.intermediate_size;
  c.num_hidden_layers = m.num_hidden_layers;
  c.num_attention_heads = m.num_attention_heads;
  c.num_key_value_heads = m.kv_heads();
  c.head_dim = m.head_dimension();
  c.rms_norm_eps = m.rms_norm_eps;
  c.rope_theta = m.rope_theta;
  if (m.rope_parameters) {
    RopeScaling s;
    s.factor = m.rope_parameters->factor;
    s.low_freq_factor = m.rope_parameters->low_freq_factor;
    s.high_freq_factor = m.rope_parameters->high_freq_factor;
    s.original_max_position_embeddings = m.rope_parameters->original_max_position_embeddings;
    c.rope_scaling = s;
  }
  c.vocab_size = m.vocab_size;
  c.tie_word_embeddings = m.tie_word_embeddings;
  c.max_position_embeddings = m.max_position_embeddings;
  c.initializer_range = m.initializer_range;
  c.validate();
  return c;
}

// Peak f32 throughput of the host, for MFU: the measured BLAS ceiling of this kind of machine
// (docs/PERF.md), shared by the ranks of one host. QUILT_PEAK_TFLOPS overrides it.
double peak_tflops_per_rank() {
  double peak = 0.25;
  if (const char* s = std::getenv("QUILT_PEAK_TFLOPS")) peak = std::atof(s);
  return peak / double(std::max(1, launch_info().local_size));
}

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::string with_commas(double v) {
  std::string s = std::to_string(static_cast<long long>(std::llround(v)));
  for (int i = int(s.size()) - 3; i > 0; i -= 3) s.insert(size_t(i), ",");
  return s;
}

// Everything one run holds.
struct Run {
  const RecipeConfig& cfg;
  ParallelDims dims;
  std::shared_ptr<Communicator> world, dp_comm;
  std::shared_ptr<LlamaForCausalLM> model;
  std::unique_ptr<DistributedDataParallel> ddp;
  std::unique_ptr<FullyShardedDataParallel> fsdp;
  std::unique_ptr<AdamW> opt;
  std::unique_ptr<LRSchedule> sched;
  std::unique_ptr<DataLoader> loader, val_loader;
  std::vector<Tensor> params;
  int64_t step = 0;  // steps completed

  Run(const RecipeConfig& c, int64_t world_size) : cfg(c), dims(check_recipe(c, world_size)) {}
};

// The layouts this trainer applies: data parallel by replication (ddp) or by sharding
// (fsdp2 over dp_shard, HSDP over dp_replicate x dp_shard).
void apply_layout(Run& r) {
  const ParallelDims& d = r.dims;
  const Strategy strategy = r.cfg.distributed.strategy;
  QUILT_CHECK(d.pp() == 1 && d.cp() == 1 && d.ep() == 1,
              "[distributed] ", d.mesh_string(),
              " is not available in this trainer yet: it runs data parallel (ddp, fsdp2, HSDP) and tensor parallel "
              "(with or without sequence_parallel), not pp, cp or ep");
  if (d.dp() == 1 && d.tp() == 1) return;
  if (strategy == Strategy::kDdp) {
    r.ddp = std::make_unique<DistributedDataParallel>(*r.model, r.dp_comm, DDPOptions{});
    return;
  }
  if (strategy == Strategy::kMegatronFsdp) log_line("strategy megatron_fsdp runs as fsdp2's sharding (parameters, gradients and optimizer state over dp_shard)");
  // The mesh torchtitan builds, keeping only axes of size > 1: (dp_replicate, dp_shard, tp).
  Shape sizes;
  std::vector<std::string> names;
  for (auto [name, size] : {std::pair<const char*, int64_t>{"dp_replicate", d.dp_replicate()},
                            {"dp_shard", d.dp_shard()}, {"tp", d.tp()}})
    if (size > 1) {
      names.push_back(name);
      sizes.push_back(size);
    }
  r.fsdp = std::make_unique<FullyShardedDataParallel>(*r.model, DeviceMesh(r.world, sizes, names),
                                                      d.tp() > 1 ? TensorParallelPlan(LlamaForCausalLM::tp_placement) : nullptr);
  if (!r.cfg.distributed.reshard_after_forward && d.dp_shard() > 1)
    for (auto& blk : r.model->model->blocks) r.fsdp->keep_gathered_through_backward(*blk);
  if (r.cfg.distributed.sequence_parallel && d.tp() > 1) {
    FullyShardedDataParallel* f = r.fsdp.get();
    r.model->model->after_embedding = [f](const Tensor& h) { return f->sequence_parallel(h); };
  }
}

// One micro-batch's loss (a plain scalar tensor on every rank for the caller to log).
Tensor micro_loss(Run& r, const Batch& b) {
  if (!r.fsdp) return r.model->loss(b.inputs, b.targets);
  return r.model->loss(r.fsdp->shard_batch(b.inputs), r.fsdp->shard_batch(b.targets));
}

// Checkpoints go through the distributed checkpoint (dtensor/checkpoint.h) in every layout:
// each rank writes the shards it owns, the directory appears by one rename once all are done,
// and a load reshards into whatever layout the resuming run uses. Optimizer tensors are saved
// as "optim.<key>", its scalars and the trainer's own state in the index metadata.
void save_checkpoint(Run& r, const std::string& root) {
  const std::string dir = (fs::path(root) / step_dir_name(r.step)).string();
  if (r.world->rank() == 0) fs::create_directories(root);
  r.world->barrier();
  dtensor::StateDict state;
  for (auto& [name, t] : r.model->state_dict()) state.emplace_back("model." + name, t);
  OptimizerState os = r.opt->state_dict();
  for (auto& [name, t] : os.tensors) state.emplace_back("optim." + name, t);
  std::map<std::string, std::string> meta;
  for (auto& [name, v] : os.scalars) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    meta["optim." + name] = buf;
  }
  meta["trainer.step"] = std::to_string(r.step);
  meta["trainer.loader"] = r.loader->state().to_json();
  meta["trainer.layout"] = r.dims.mesh_string();
  meta["trainer.recipe"] = recipe_to_yaml(r.cfg);
  dtensor::save_checkpoint(dir, state, *r.world, meta);
  if (r.world->rank() == 0 && r.cfg.checkpoint.keep_last > 0) {
    std::vector<std::string> all;
    for (const auto& e : fs::directory_iterator(root)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step_", 0) == 0 && n.find(".tmp") == std::string::npos) all.push_back(e.path().string());
    }
    std::sort(all.begin(), all.end());
    for (size_t i = 0; i + size_t(r.cfg.checkpoint.keep_last) < all.size(); ++i) fs::remove_all(all[i]);
  }
  r.world->barrier();
  log_line("checkpoint: saved ", dir);
}

void load_checkpoint(Run& r, const std::string& dir) {
  const dtensor::CheckpointInfo info = dtensor::read_checkpoint_info(dir);
  dtensor::StateDict targets;
  for (auto& [name, t] : r.model->state_dict()) targets.emplace_back("model." + name, t);
  // Optimizer moments take their parameter's layout; their names are "optim.state.<param>.<buffer>".
  std::map<std::string, Tensor> by_name;
  for (const Tensor& p : r.params) by_name[p.name()] = p;
  OptimizerState os;
  for (const auto& ti : info.tensors) {
    if (ti.name.rfind("optim.", 0) != 0) continue;
    const std::string key = ti.name.substr(6);
    const std::string rest = key.rfind("state.", 0) == 0 ? key.substr(6) : key;
    const auto dot = rest.rfind('.');
    auto it = by_name.find(dot == std::string::npos ? rest : rest.substr(0, dot));
    QUILT_CHECK(it != by_name.end(), "[checkpoint] ", dir, ": optimizer tensor '", ti.name,
                "' belongs to no parameter of this model");
    const Tensor& p = it->second;
    Tensor local = zeros(p.local().shape(), {.dtype = ti.dtype, .device = p.device()});
    Tensor t = p.is_distributed() ? Tensor::make_distributed(local, p.dist_spec(), p.shape()) : local;
    targets.emplace_back(ti.name, t);
    os.tensors.insert(key, t);
  }
  dtensor::load_checkpoint(dir, targets);
  for (auto& [k, v] : info.metadata)
    if (k.rfind("optim.", 0) == 0) os.scalars.insert(k.substr(6), std::stod(v));
  r.opt->load_state_dict(os);
  r.step = std::stoll(info.metadata.at("trainer.step"));
  r.loader->load_state(LoaderState::from_json(info.metadata.at("trainer.loader")));
  log_line("checkpoint: resumed from ", dir, " at step ", r.step, " (saved as ", info.metadata.at("trainer.layout"), ")");
}

// The model tensors of a checkpoint as one HF safetensors file: the "model." prefix the trainer
// adds is dropped, the optimizer state left out.
void export_hf(const std::string& checkpoint_dir, const std::string& out_path) {
  const std::string tmp = out_path + ".all.safetensors";
  dtensor::export_consolidated(checkpoint_dir, tmp);
  SafetensorsFile all = load_safetensors(tmp, {.mmap = false});
  std::vector<std::pair<std::string, Tensor>> model;
  for (const std::string& name : all.names)
    if (name.rfind("model.", 0) == 0) model.emplace_back(name.substr(6), all.tensors.at(name));
  save_safetensors(out_path, model, {{"format", "pt"}});
  fs::remove(tmp);
}

double validation_loss(Run& r) {
  if (!r.val_loader) return -1;
  NoGradGuard ng;
  r.model->eval();
  r.val_loader->reset();
  double total = 0;
  const int64_t n = std::max<int64_t>(1, r.cfg.train.eval_steps);
  for (int64_t s = 0; s < n; ++s) {
    double step_sum = 0;
    auto batches = r.val_loader->next_step();
    for (const Batch& b : batches) {
      Tensor l = micro_loss(r, b);
      step_sum += (l.is_distributed() ? full_tensor(l) : l).item<double>();
    }
    total += step_sum / double(batches.size());
  }
  Tensor t = scalar_tensor(total / double(n), {.dtype = DType::f64});
  if (!r.fsdp && r.dp_comm->size() > 1) r.dp_comm->all_reduce(t, ReduceOp::avg);
  r.model->train();
  return t.item<double>();
}

std::unique_ptr<Run> setup(const RecipeConfig& cfg) {
  Communicator& w = world();
  auto r = std::make_unique<Run>(cfg, w.size());
  r->world = world_ptr();
  r->world->set_timeout(std::chrono::milliseconds(int64_t(cfg.dist_env.timeout_s * 1000)));
  r->dims.check_seq_len(cfg.train.seq_len);
  log_line(r->dims.mesh_string());
  // Ranks share the host's cores: each takes its share (OMP_NUM_THREADS, when set, decides).
  if (!std::getenv("OMP_NUM_THREADS")) {
    const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
    kernels::cpu::set_gemm_threads(std::max(1, cores / std::max(1, launch_info().local_size)));
  }
  r->dp_comm = r->world;  // data parallel is the whole world in the layouts this trainer runs
  r->model = std::make_shared<LlamaForCausalLM>(llama_config(cfg.model));
  r->model->init_weights(uint64_t(cfg.train.seed));
  apply_layout(*r);
  // Gradients reach the f32 masters through the casts, so every reduction runs in the master
  // dtype and module outputs keep the compute dtype; other choices are refused, not ignored.
  QUILT_CHECK(!cfg.train.reduce_dtype || *cfg.train.reduce_dtype == cfg.train.dtype, "[train.reduce_dtype] ",
              dtype_name(*cfg.train.reduce_dtype), " is not supported: gradients are reduced in train.dtype (",
              dtype_name(cfg.train.dtype), ")");
  QUILT_CHECK(!cfg.train.output_dtype || *cfg.train.output_dtype == cfg.train.param_dtype.value_or(cfg.train.dtype),
              "[train.output_dtype] ", dtype_name(*cfg.train.output_dtype),
              " is not supported: module outputs are in the compute dtype (train.param_dtype)");
  if (cfg.train.param_dtype && *cfg.train.param_dtype != cfg.train.dtype) {
    QUILT_CHECK(!cfg.model.tie_word_embeddings, "[train.param_dtype] mixed precision with tie_word_embeddings is not supported");
    apply_mixed_precision(*r->model, {.param_dtype = *cfg.train.param_dtype});
  }
  if (cfg.distributed.activation_checkpointing) {
    // Every block recomputed in backward: only its input is kept from forward.
    const CheckpointMode mode =
        cfg.distributed.activation_checkpointing_mode == "selective" ? CheckpointMode::save_matmuls : CheckpointMode::full;
    r->model->model->block_runner = [mode](LlamaDecoderLayer& blk, const Tensor& x) {
      return checkpoint([&blk](const Tensor& in) { return blk(in); }, x, nullptr, mode);
    };
  }
  r->params = r->model->parameters();
  {
    int64_t total = 0, mine = 0;
    for (const Tensor& p : r->params) {
      total += p.numel();
      mine += p.local().numel();
    }
    // Parameters, gradients and AdamW's two moments, all f32: the state a layout divides.
    log_line("parameters: ", total, " in all, ", mine, " on this rank (", (mine * 16) >> 10,
             " KiB of parameters + gradients + optimizer state)");
  }
  const TrainConfig& t = cfg.train;
  // No weight decay on norms (1-D parameters), as is usual for Llama training.
  std::vector<Tensor> decay, no_decay;
  for (const Tensor& p : r->params) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::vector<ParamGroup> groups{{decay, std::nullopt, t.weight_decay}, {no_decay, std::nullopt, 0.0}};
  r->opt = std::make_unique<AdamW>(groups, AdamWOptions{.lr = t.lr, .beta1 = t.beta1, .beta2 = t.beta2, .eps = t.eps,
                                                        .weight_decay = t.weight_decay});
  r->sched = std::make_unique<LRSchedule>(LRSchedule::Options{
      .max_lr = t.lr, .min_lr = t.min_lr, .init_lr = 0.0, .warmup_steps = t.warmup_steps,
      .decay_steps = std::max(t.steps, t.warmup_steps + 1),  // short runs may end inside the warmup
      .style = t.decay == Decay::kLinear ? LRDecayStyle::linear : LRDecayStyle::cosine});
  const int64_t dp_rank = r->dims.dp_rank(w.rank());
  auto data = std::make_shared<const TokenDataset>(cfg.data.path, cfg.data.format);
  data->check_vocab(cfg.model.vocab_size);
  r->loader = std::make_unique<DataLoader>(
      data, LoaderOptions{.seq_len = t.seq_len, .global_batch_size = t.global_batch_size,
                          .micro_batch_size = t.micro_batch_size, .dp_rank = dp_rank, .dp_size = r->dims.dp(),
                          .seed = uint64_t(t.seed), .shuffle = true});
  if (cfg.data.val_path) {
    auto val = std::make_shared<const TokenDataset>(*cfg.data.val_path, cfg.data.format);
    r->val_loader = std::make_unique<DataLoader>(
        val, LoaderOptions{.seq_len = t.seq_len, .global_batch_size = t.global_batch_size,
                           .micro_batch_size = t.micro_batch_size, .dp_rank = dp_rank, .dp_size = r->dims.dp(),
                           .seed = uint64_t(t.seed), .shuffle = false});
  }
  return r;
}

}  // namespace

std::string latest_checkpoint(const std::string& dir) {
  if (dir.empty() || !fs::exists(dir)) return "";
  return dtensor::latest_checkpoint(dir);
}

TrainResult train(const RecipeConfig& cfg, int64_t stop_after) {
  std::unique_ptr<Run> run = setup(cfg);
  Run& r = *run;
  const TrainConfig& t = cfg.train;
  if (cfg.checkpoint.dir) {
    std::string from;
    if (cfg.checkpoint.resume.kind == ResumeSpec::Kind::kAuto) from = latest_checkpoint(*cfg.checkpoint.dir);
    if (cfg.checkpoint.resume.kind == ResumeSpec::Kind::kPath) from = cfg.checkpoint.resume.path;
    if (!from.empty()) load_checkpoint(r, from);
  }
  std::ofstream metrics;
  if (cfg.logging.dir && r.world->rank() == 0) {
    fs::create_directories(*cfg.logging.dir);
    metrics.open((fs::path(*cfg.logging.dir) / "metrics.jsonl").string(), std::ios::app);
  }
  TrainResult result;
  const int64_t accum = r.loader->accumulation_steps();
  const double tokens_per_step = double(t.global_batch_size * t.seq_len);
  const double flops_per_token = r.model->flops_per_token(t.seq_len);
  r.model->train();
  const int64_t last = stop_after >= 0 ? std::min(stop_after, t.steps) : t.steps;
  while (r.step < last) {
    const auto t0 = std::chrono::steady_clock::now();
    reset_cpu_peak_memory();
    const double lr = r.sched->lr_at(r.opt->step_count());
    r.opt->set_lr(lr);
    std::vector<Batch> batches = r.loader->next_step();
    double loss_sum = 0;
    for (int64_t m = 0; m < accum; ++m) {
      if (r.ddp) r.ddp->set_sync(m == accum - 1);
      if (r.fsdp && cfg.distributed.defer_fsdp_grad_sync) r.fsdp->set_requires_gradient_sync(m == accum - 1);
      Tensor loss = micro_loss(r, batches[size_t(m)]);
      (loss * (1.0 / double(accum))).backward();
      loss_sum += (loss.is_distributed() ? full_tensor(loss.detach()) : loss).item<double>();
    }
    if (r.ddp) r.ddp->finish();
    Tensor loss_t = scalar_tensor(loss_sum / double(accum), {.dtype = DType::f64});
    if (r.ddp) r.dp_comm->all_reduce(loss_t, ReduceOp::avg);  // fsdp's loss is already the global mean
    const double loss = loss_t.item<double>();
    const double max_norm = t.max_grad_norm.value_or(INFINITY);
    const double norm = (r.fsdp ? dtensor::clip_grad_norm_(r.params, max_norm) : clip_grad_norm_(r.params, max_norm))
                            .item<double>();
    // Every rank holds the same averaged loss and gradients, so all take the same decision.
    const bool finite = std::isfinite(loss) && std::isfinite(norm);
    if (finite) r.opt->step();
    else log_line("step ", r.step + 1, ": non-finite ", std::isfinite(loss) ? "gradient norm" : "loss", ", step skipped on every rank");
    r.opt->zero_grad();
    ++r.step;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    StepMetrics sm;
    sm.step = r.step;
    sm.loss = loss;
    sm.grad_norm = norm;
    sm.lr = lr;
    sm.skipped = !finite;
    sm.tps = tokens_per_step / secs;
    sm.tflops = flops_per_token * tokens_per_step / double(r.world->size()) / secs / 1e12;
    sm.mfu = sm.tflops / peak_tflops_per_rank();
    sm.memory_gib = double(cpu_memory_stats().peak_allocated) / double(int64_t(1) << 30);
    result.steps.push_back(sm);
    if (r.step % std::max<int64_t>(1, cfg.logging.every_steps) == 0 || r.step == 1 || r.step == last) {
      char line[256];
      std::snprintf(line, sizeof line, "step: %lld  loss: %.4f  grad_norm: %.4f  memory: %.2fGiB  tps: %s  tflops: %.3f  mfu: %.2f%%",
                    static_cast<long long>(r.step), loss, norm, sm.memory_gib, with_commas(sm.tps).c_str(), sm.tflops,
                    sm.mfu * 100);
      log_line(line);
    }
    if (metrics.is_open()) {
      nlohmann::json j = {{"step", sm.step}, {"loss", sm.loss}, {"grad_norm", sm.grad_norm}, {"lr", sm.lr},
                          {"tps", sm.tps}, {"tflops", sm.tflops}, {"mfu", sm.mfu}, {"memory_gib", sm.memory_gib}};
      if (sm.skipped) j["skipped"] = true;
      metrics << j.dump() << "\n";
      metrics.flush();
    }
    if (cfg.train.eval_every > 0 && r.step % cfg.train.eval_every == 0 && r.val_loader) {
      const double vl = validation_loss(r);
      char line[96];
      std::snprintf(line, sizeof line, "validation: step %lld  loss: %.4f", static_cast<long long>(r.step), vl);
      log_line(line);
    }
    if (cfg.checkpoint.dir && cfg.checkpoint.every_steps > 0 && r.step % cfg.checkpoint.every_steps == 0 &&
        r.step < last)
      save_checkpoint(r, *cfg.checkpoint.dir);
  }
  if (cfg.checkpoint.dir && !result.steps.empty()) {
    save_checkpoint(r, *cfg.checkpoint.dir);
    if (cfg.checkpoint.save_consolidated && r.world->rank() == 0) {
      // HF layout: model.safetensors (+ index when large) with HF names, and config.json.
      const std::string src = (fs::path(*cfg.checkpoint.dir) / step_dir_name(r.step)).string();
      const fs::path out = fs::path(*cfg.checkpoint.dir) / "hf";
      fs::create_directories(out);
      export_hf(src, (out / "model.safetensors").string());
      std::ofstream((out / "config.json").string()) << llama_config(cfg.model).to_json();
      log_line("checkpoint: consolidated HF weights in ", out.string());
    }
    r.world->barrier();
  }
  result.final_val_loss = validation_loss(r);
  if (result.final_val_loss >= 0) log_line("validation loss: ", result.final_val_loss);
  return result;
}

double evaluate(const RecipeConfig& cfg, const std::string& checkpoint_dir) {
  std::unique_ptr<Run> run = setup(cfg);
  load_checkpoint(*run, checkpoint_dir);
  QUILT_CHECK(run->val_loader != nullptr, "[eval] the recipe has no data.val_path");
  return validation_loss(*run);
}

}  // namespace quilt
