// Building a run: see run.h.
#include "tools/run.h"

#include <cstdio>
#include <filesystem>
#include <optional>
#include <fstream>
#include <sstream>
#include <thread>

#include "collectives/agree.h"
#include "collectives/launch.h"
#include "kernels/cpu/matmul.h"
#include "models/llama/parallelize.h"
#include "parallel/mixed_precision.h"
#include "parallel/pipeline/split.h"
#include "tools/tokenizer.h"

namespace quilt {
namespace fs = std::filesystem;

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
  c.model_type = m.model_type;
  c.qk_norm = m.qk_norm.value_or(m.model_type != "llama");
  c.num_experts = m.num_experts;
  c.num_experts_per_tok = m.num_experts_per_tok;
  c.moe_intermediate_size = m.moe_intermediate_size;
  c.norm_topk_prob = m.norm_topk_prob;
  c.decoder_sparse_step = m.decoder_sparse_step;
  c.mlp_only_layers = m.mlp_only_layers;
  c.first_k_dense_replace = m.first_k_dense_replace;
  c.scoring_func = m.scoring_func;
  c.n_group = m.n_group;
  c.topk_group = m.topk_group;
  c.routed_scaling_factor = m.routed_scaling_factor;
  c.n_shared_experts = m.n_shared_experts;
  c.score_correction_bias = m.score_correction_bias;
  c.load_balance_coeff = m.load_balance_coeff;
  c.router_aux_loss_coef = m.router_aux_loss_coef;
  c.validate();
  return c;
}

Run::Run(const RecipeConfig& c, int64_t world_size) : cfg(c), dims(check_recipe(c, world_size)) {}

namespace {

// model.pretrained: the HF directory must describe the recipe's model; every field that
// disagrees is named before any weight is read.
std::string pretrained_weights(const ModelConfig& m) {
  const fs::path dir(*m.pretrained);
  const fs::path config = dir / "config.json";
  QUILT_CHECK(fs::exists(config), "[model.pretrained] ", dir.string(), " has no config.json");
  std::ifstream in(config);
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<std::string> bad = model_config_mismatches(m, text.str());
  if (!bad.empty()) {
    std::string msg = "[model.pretrained] the recipe's model does not match " + config.string() + ":";
    for (const std::string& b : bad) msg += "\n  " + b;
    fail(msg);
  }
  for (const char* name : {"model.safetensors.index.json", "model.safetensors"})
    if (fs::exists(dir / name)) return (dir / name).string();
  fail("[model.pretrained] ", dir.string(), " has neither model.safetensors nor model.safetensors.index.json");
}

std::unique_ptr<DataLoader> make_loader(const RecipeConfig& cfg, const std::string& path, int64_t dp_rank,
                                        int64_t dp_size, bool shuffle) {
  auto data = std::make_shared<const TokenDataset>(path, cfg.data.format);
  data->check_vocab(cfg.model.vocab_size);
  const TrainConfig& t = cfg.train;
  return std::make_unique<DataLoader>(
      data, LoaderOptions{.seq_len = t.seq_len, .global_batch_size = t.global_batch_size,
                          .micro_batch_size = t.micro_batch_size, .dp_rank = dp_rank, .dp_size = dp_size,
                          .seed = uint64_t(t.seed), .shuffle = shuffle,
                          .packed_sequence_size = cfg.packed_sequence.packed_sequence_size,
                          .document_token = make_tokenizer(cfg.data.tokenizer)->eot_token(),
                          .document_multiple = packing_document_multiple(cfg)});
}

}  // namespace

std::unique_ptr<Run> build_run(const RecipeConfig& cfg) {
  auto r = std::make_unique<Run>(cfg, world().size());
  r->world = world_ptr();
  r->world->set_timeout(std::chrono::milliseconds(int64_t(cfg.dist_env.timeout_s * 1000)));
  r->dims.check_seq_len(cfg.train.seq_len);
  log_line(r->dims.mesh_string());
  // Ranks share the host's cores: each takes its share (OMP_NUM_THREADS, when set, decides).
  if (!std::getenv("OMP_NUM_THREADS")) {
    const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
    kernels::cpu::set_gemm_threads(std::max(1, cores / std::max(1, launch_info().local_size)));
  }
  log_line("gemm: ", kernels::cpu::gemm_backend(), " (", kernels::cpu::gemm_backend_reason(), "), ",
           kernels::cpu::gemm_threads(), " threads per rank");
  r->meshes = r->dims.build_meshes(r->world);
  const std::string weights = cfg.model.pretrained ? pretrained_weights(cfg.model) : "";

  // Model: the same values on every rank (Philox keyed by name and global index). Under FSDP
  // it is built without storage and each rank materialises only its own shards, initialised
  // after sharding; under DDP it is initialised whole, then replicated.
  const TrainConfig& t = cfg.train;
  // train.device cuda: each rank trains on its GPU (local rank % the GPUs it sees, as the
  // launcher chose). The model is built and initialised whole on the host, takes its pretrained
  // weights there, moves to the GPU, and is then laid out by the plan (fsdp shards, ddp buckets,
  // tp splits) where it lies; collectives go over NCCL or, under MPI, through host memory.
  const bool on_gpu = t.device == TrainDevice::kCuda;
  if (on_gpu) {
    QUILT_CHECK(cuda::is_available(), "[config] train.device cuda: no usable GPU (", cuda::unavailable_reason(), ")");
    const LaunchInfo& li = launch_info();
    r->device = li.device.is_cuda() ? li.device : Device::cuda(device_for_local_rank(li.local_rank, cuda::device_count()));
    cuda::set_device(r->device.index);
    log_line("device: ", r->device.str(), " (GPU ", cuda::pci_bus_id(r->device.index), "; local rank ", li.local_rank,
             " of ", li.local_size, ", ", cuda::device_count(), " GPUs visible), collectives over ", r->world->backend(),
             r->world->backend() == "nccl" ? "" : " through host memory");
  }
  const bool deferred = !on_gpu && cfg.distributed.strategy != Strategy::kDdp;
  const DistributedConfig& plan = cfg.distributed;
  const int64_t before = cpu_memory_stats().allocated;
  reset_cpu_peak_memory();
  // Without a pipeline this rank holds the whole model (one "stage"); with one, the stages the
  // schedule puts on its pipeline rank, each parallelized on its own.
  const LlamaConfig lcfg = llama_config(cfg.model);
  std::vector<int> my_stages{0};
  std::vector<pipeline::StageSpan> spans{{.first_layer = 0, .end_layer = lcfg.num_hidden_layers, .embed = true, .head = true}};
  pipeline::Lowered lists;
  const PipelineConfig& pc = cfg.distributed.pipeline;
  const int64_t pp = r->dims.pp();
  if (pp > 1) {
    const int64_t n_micro = t.micro_batch_size / pc.pp_microbatch_size;
    const pipeline::Schedule schedule = pipeline::make_schedule(pc.pp_schedule, int(pp), int(n_micro), 2);
    lists = pipeline::lower(schedule);
    pipeline::validate(lists);
    const std::vector<int> ranks = pipeline::stage_ranks(lists);
    // The embedding and the head weigh as many layers as they cost (the head's GEMM against
    // an average layer's), so no pipeline rank carries a layer more than the split needs.
    double layer_macs = 0;
    for (int64_t l = 0; l < lcfg.num_hidden_layers; ++l) layer_macs += lcfg.layer_macs_per_token(l, t.seq_len);
    layer_macs /= double(lcfg.num_hidden_layers);
    const pipeline::PseudoLayerWeights split_w = pipeline::pseudo_layer_weights(
        lcfg.num_hidden_layers, int64_t(ranks.size()), 0.0, lcfg.head_macs_per_token() / layer_macs);
    spans = pipeline::split_layers(lcfg.num_hidden_layers, int64_t(ranks.size()), split_w.input, split_w.output);
    const int me = int(r->dims.coords(r->world->rank()).pp);
    my_stages.clear();
    for (size_t s = 0; s < ranks.size(); ++s)
      if (ranks[s] == me) my_stages.push_back(int(s));
    std::string layout;
    for (size_t s = 0; s < spans.size(); ++s)
      layout += detail::concat(s ? ", " : "", s, ": layers [", spans[s].first_layer, ", ", spans[s].end_layer, ")",
                               spans[s].embed ? " + embedding" : "", spans[s].head ? " + head" : "", " on rank ",
                               ranks[s]);
    char modelled[32];
    std::snprintf(modelled, sizeof modelled, "%.1f%%", 100 * pipeline::bubble_fraction(schedule));
    log_line("pipeline: ", pc.pp_schedule, ", ", ranks.size(), " stages over ", pp, " ranks, ", n_micro,
             " micro-batches of ", pc.pp_microbatch_size, " (stage ", layout, "; the embedding weighs ",
             split_w.input, " layers and the head ", split_w.output, "); modelled idle share ", modelled,
             " (F 1, B 2, I 1, W 1)");
  }
  LlamaParallelizeOptions popts;
  popts.param_dtype = t.param_dtype;
  popts.reduce_dtype = t.reduce_dtype;
  popts.output_dtype = t.output_dtype;
  std::vector<pipeline::StageRef> refs;
  for (int s : my_stages) {
    const pipeline::StageSpan& sp = spans[size_t(s)];
    std::shared_ptr<LlamaForCausalLM> m;
    {
      std::optional<DeferredInitGuard> guard;
      if (deferred) guard.emplace();
      m = std::make_shared<LlamaForCausalLM>(
          lcfg, LlamaStage{.first_layer = sp.first_layer, .end_layer = sp.end_layer, .embed = sp.embed, .head = sp.head});
    }
    if (!deferred) m->init_weights(uint64_t(t.seed));
    if (on_gpu) {
      if (!weights.empty()) load_hf_weights(*m, weights);
      m->to(r->device);
    }
    DataParallelism dp = parallelize_llama(*m, r->meshes, plan, popts);
    if (deferred) m->init_weights(uint64_t(t.seed));
    // Under tp the residual stream between blocks (so between stages) is each rank's plain
    // shard (the tp plan lays it out at every block's input), so it travels as it is.
    LlamaForCausalLM* raw = m.get();
    refs.push_back({.stage = s, .forward = [raw](const Tensor& x, const Tensor& pos, const Tensor& docs) { return (*raw)(x, pos, docs); }, .dp = dp});
    r->stages.push_back(m);
    if (!r->model) {
      r->model = m;
      r->dp = dp;
    }
  }
  {
    int64_t full_bytes = 0;
    double flops = 0;
    for (const auto& m : r->stages) {
      for (const Tensor& p : m->parameters()) full_bytes += p.numel() * int64_t(dtype_size(p.dtype()));
      flops += m->flops_per_token(t.seq_len);
    }
    // The whole model's FLOPs per token: every pipeline rank's stages together.
    Tensor f = scalar_tensor(flops, {.dtype = DType::f64});
    if (pp > 1) r->meshes["pp"].comm_ptr(0)->all_reduce(f, ReduceOp::sum);
    r->flops_per_token = f.item<double>();
    log_line("model: ", deferred ? "built without storage, each rank initialised its shards" : "initialised whole",
             "; host memory peak while building: ", (cpu_memory_stats().peak_allocated - before) >> 10,
             " KiB (full parameters", pp > 1 ? " of this rank's stages" : "", ": ", full_bytes >> 10, " KiB)");
  }
  // Pretrained weights go straight into whatever layout the plan made (each rank reads its shards).
  if (!weights.empty()) {
    if (!on_gpu)
      for (const auto& m : r->stages) load_hf_weights(*m, weights);
    log_line("model: weights from ", weights);
  }
  for (const auto& m : r->stages)
    for (const Tensor& p : m->parameters()) r->params.push_back(p);
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

  // Each rank opens the data itself: one that cannot stops every rank.
  const int64_t dp_rank = r->dims.dp_rank(r->world->rank());
  agree(*r->world, "opening the data", [&] {
    r->loader = make_loader(cfg, cfg.data.path, dp_rank, r->dims.dp(), /*shuffle=*/true);
    if (cfg.data.val_path) r->val_loader = make_loader(cfg, *cfg.data.val_path, dp_rank, r->dims.dp(), false);
  });

  // The step: losses averaged over the ranks that see different tokens (dp x cp).
  const auto loss_comm = r->meshes["dp_cp"].comm_ptr(0);
  if (pp > 1) {
    r->pp_comm = r->meshes["pp"].comm_ptr(0);
    if (r->pp_comm->backend() == "nccl") {
      // The schedule's transfers are matched by tag, NCCL's by order: the pp axis of a mesh
      // built over the host world carries them, GPU tensors staged through host memory.
      r->pp_comm = r->dims.build_meshes(cpu_world().shared_from_this())["pp"].comm_ptr(0);
      log_line("pipeline: transfers over ", r->pp_comm->backend(), " through host memory (the rest over nccl)");
    }
    r->step = std::make_unique<PipelineTrainStep>(
        std::move(lists), std::move(refs), int(spans.size()),
        PipelineStepOptions{.rows = pc.pp_microbatch_size, .scale_in_schedule = pc.scale_grads_in_schedule,
                            .pp_comm = r->pp_comm, .loss_comm = loss_comm, .params = r->params,
                            .device = r->device});
    return r;
  }
  LlamaForCausalLM* m = r->model.get();
  r->step = std::make_unique<LocalTrainStep>(
      [m](const Tensor& tokens, const Tensor& positions, const Tensor& docs) { return (*m)(tokens, positions, docs); },
      StepHooks{.device = r->device, .dp = r->dp, .defer_fsdp_grad_sync = cfg.distributed.defer_fsdp_grad_sync, .loss_comm = loss_comm,
                .cp_comm = r->dims.cp() > 1 ? r->meshes["cp"].comm_ptr(0) : nullptr});
  return r;
}

}  // namespace quilt
