// Recipes: parsing, overrides, unknown keys, value rules, cross-section rules, YAML round trip.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "engine/error.h"
#include "tools/config.h"

using namespace quilt;

namespace {

const std::string kMinimal = "data: {path: shards/train_*.bin}\n";

RecipeConfig parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return parse_recipe(text, overrides, "test.yaml");
}

std::string recipe_path(const std::string& name) { return std::string(QUILT_SOURCE_DIR) + "/recipes/" + name; }

}  // namespace

TEST_CASE("config: a recipe naming only data.path takes every default") {
  RecipeConfig c = parse(kMinimal);
  CHECK(c.data.path == "shards/train_*.bin");
  CHECK(c.model.hidden_size == 128);
  CHECK(c.train.steps == 100);
  CHECK(c.distributed.strategy == Strategy::kFsdp2);
  CHECK_FALSE(c.distributed.dp_size.has_value());
  CHECK(c.dist_env.backend == Backend::kMpi);
  CHECK(c.checkpoint.resume.kind == ResumeSpec::Kind::kAuto);
  CHECK(c.source == "test.yaml");
}

TEST_CASE("config: the default recipe loads with its values") {
  RecipeConfig c = load_recipe(recipe_path("llama_tiny.yaml"));
  CHECK(c.model.model_type == "llama");
  CHECK(c.model.num_hidden_layers == 4);
  CHECK(c.model.num_attention_heads == 4);
  CHECK(c.model.kv_heads() == 2);
  CHECK(c.model.head_dimension() == 32);
  CHECK(c.model.vocab_size % 64 == 0);
  CHECK(c.model.rms_norm_eps == doctest::Approx(1e-5));
  CHECK(c.train.seq_len == 128);
  CHECK(c.train.lr == doctest::Approx(2e-3));
  CHECK(c.train.decay == Decay::kCosine);
  CHECK(c.train.max_grad_norm == 1.0);
  CHECK_FALSE(c.train.param_dtype.has_value());
  CHECK(c.data.val_path.has_value());
  CHECK(c.distributed.pipeline.pp_schedule == "1f1b");
  CHECK(c.distributed.moe.ignore_router_for_ac);
  CHECK_FALSE(c.checkpoint.dir.has_value());
  // ~0.9M parameters: 2 * 320 * 128 (embedding, head) + 4 layers of 196,864 + final norm.
  CHECK(c.model.num_parameters() == 2 * 320 * 128 + 4 * (128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 384 + 256) + 128);
}

TEST_CASE("config: every recipe in recipes/ passes every rule at its smallest world") {
  int seen = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(QUILT_SOURCE_DIR) + "/recipes")) {
    if (e.path().extension() != ".yaml") continue;
    CAPTURE(e.path().string());
    RecipeConfig c = load_recipe(e.path().string());
    ParallelDims d = check_recipe(c, default_world_size(c));
    CHECK(d.world() >= 1);
    ++seen;
  }
  CHECK(seen >= 5);
  CHECK(check_recipe(load_recipe(recipe_path("tp2.yaml")), 4).mesh_string() ==
        "mesh: world=4 dp_replicate=1 dp_shard=2 cp=1 tp=2 pp=1 ep=1");
  CHECK(check_recipe(load_recipe(recipe_path("hsdp2x2.yaml")), 4).mesh_string() ==
        "mesh: world=4 dp_replicate=2 dp_shard=2 cp=1 tp=1 pp=1 ep=1");
  CHECK(check_recipe(load_recipe(recipe_path("ddp2.yaml")), 2).mesh_string() ==
        "mesh: world=2 dp_replicate=2 dp_shard=1 cp=1 tp=1 pp=1 ep=1");
}

TEST_CASE("config: overrides set values at any depth, create sections, and take none and maps") {
  RecipeConfig c = parse(kMinimal, {"train.steps=20", "distributed.pipeline.pp_schedule=gpipe",
                                    "checkpoint.dir=/tmp/ck", "model.num_key_value_heads=none",
                                    "distributed.moe={wrap_outer_model: false}", "train.steps=30"});
  CHECK(c.train.steps == 30);  // the last --set of a key wins
  CHECK(c.distributed.pipeline.pp_schedule == "gpipe");
  CHECK(c.checkpoint.dir == "/tmp/ck");
  CHECK_FALSE(c.model.num_key_value_heads.has_value());
  CHECK_FALSE(c.distributed.moe.wrap_outer_model);
  CHECK(c.distributed.moe.ignore_router_for_ac);  // untouched keys of the replaced map keep defaults
  // On an empty recipe, overrides alone make it.
  CHECK(parse("", {"data.path=x.bin", "train.seq_len=64"}).train.seq_len == 64);
}

TEST_CASE("config: an override of the wrong type names the key, the expected type and the --set") {
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"train.steps=abc"}),
                       "[config] train.steps: expected an integer, got 'abc' (from --set train.steps=abc)", Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"train.lr=fast"}), doctest::Contains("train.lr: expected a finite number"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"distributed.sequence_parallel=maybe"}),
                       doctest::Contains("distributed.sequence_parallel: expected true or false"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"train.steps"}), doctest::Contains("--set expects key=value"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"train..steps=3"}), doctest::Contains("is not a dotted key"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {steps: 100}\n", {"train.steps.x=3"}),
                       doctest::Contains("--set train.steps.x=3: train.steps is '100', not a section"), Error);
}

TEST_CASE("config: unknown keys at every level name the dotted key and list the valid ones") {
  CHECK_THROWS_WITH_AS(parse(kMinimal + "trian: {steps: 3}\n"),
                       doctest::Contains("unknown key 'trian' (test.yaml:2); valid keys: model, data, packed_sequence, train"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train:\n  steps: 3\n  stpes: 4\n"),
                       doctest::Contains("unknown key 'train.stpes' (test.yaml:4); valid keys of train: steps, "
                                         "global_batch_size"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "distributed: {pipeline: {pp_schedul: gpipe}}\n"),
                       doctest::Contains("unknown key 'distributed.pipeline.pp_schedul'"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "distributed: {pipeline: {pp_schedul: gpipe}}\n"),
                       doctest::Contains("valid keys of distributed.pipeline: pp_schedule, pp_microbatch_size, "
                                         "scale_grads_in_schedule"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"model.hidden=64"}),
                       doctest::Contains("unknown key 'model.hidden' (from --set model.hidden=64)"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"modle.hidden_size=64"}),
                       doctest::Contains("unknown key 'modle' (from --set modle.hidden_size=64)"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {steps: 3, steps: 4}\n"), doctest::Contains("'train.steps' appears twice"),
                       Error);
}

TEST_CASE("config: bad values name the key and the line") {
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train:\n  steps: -1\n"),
                       "[config] train.steps must be >= 0, got -1 (test.yaml:3)", Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train:\n  steps: 0\n"),
                       doctest::Contains("train.steps is 0 but checkpoint.save_consolidated is false"), Error);
  CHECK(parse(kMinimal + "train: {steps: 0}\ncheckpoint: {dir: /tmp/x, save_consolidated: true}\n").train.steps == 0);
  CHECK(std::get<int64_t>(parse(kMinimal, {"distributed.reshard_after_forward=2"}).distributed.reshard_after_forward) == 2);
  CHECK(!std::get<bool>(parse(kMinimal, {"distributed.reshard_after_forward=false"}).distributed.reshard_after_forward));
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"distributed.reshard_after_forward=0"}),
                       doctest::Contains("distributed.reshard_after_forward must be true, false or a group size >= 1"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"distributed.reshard_after_forward=maybe"}),
                       doctest::Contains("distributed.reshard_after_forward"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {lr: -1}\n"), doctest::Contains("train.lr must be > 0, got -1"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {steps: 2.5}\n"), doctest::Contains("expected an integer, got '2.5'"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {decay: step}\n"),
                       doctest::Contains("train.decay: expected one of cosine | linear, got 'step'"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {dtype: int8}\n"),
                       doctest::Contains("train.dtype: expected float32 | bfloat16 | float16 | float64"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {beta2: 1.0}\n"), doctest::Contains("train.beta2 must be < 1"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {lr: 1.0e-3, min_lr: 1.0e-2}\n"),
                       doctest::Contains("train.min_lr 0.01 is greater than train.lr 0.001"), Error);
  // A warm-up longer than a short smoke run (--set train.steps=5) is allowed: the lr just stays low.
  CHECK(parse(kMinimal + "train: {steps: 5, warmup_steps: 20}\n").train.warmup_steps == 20);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {global_batch_size: 6, micro_batch_size: 4}\n"),
                       doctest::Contains("train.global_batch_size 6 is not divisible by train.micro_batch_size 4"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {seq_len: [1, 2]}\n"),
                       doctest::Contains("train.seq_len: expected an integer, got a list"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "dist_env: {backend: gloo}\n"),
                       doctest::Contains("dist_env.backend: expected one of mpi | nccl | threads"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "dist_env: {timeout_s: 0}\n"), doctest::Contains("dist_env.timeout_s must be > 0"),
                       Error);
  CHECK_THROWS_WITH_AS(parse("data: {path: x, tokenizer: gpt2}\n"),
                       doctest::Contains("data.tokenizer: expected one of byte"), Error);
  CHECK_THROWS_WITH_AS(parse("data: {format: llmc}\n"), doctest::Contains("data.path is required"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {model_type: gpt2}\n"),
                       doctest::Contains("model.model_type: expected one of llama"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "logging: {every_steps: 0}\n"),
                       doctest::Contains("logging.every_steps must be >= 1"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "distributed: {tp_size: 0}\n"),
                       doctest::Contains("distributed.tp_size must be >= 1, got 0"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: [1, 2]\n"), doctest::Contains("train: expected a map of keys, got a list"),
                       Error);
  CHECK_THROWS_WITH_AS(parse("- a\n- b\n"), doctest::Contains("test.yaml: expected a map of keys, got a list"), Error);
}

TEST_CASE("config: rules between sections name every key involved") {
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {vocab_size: 256}\n"),
                       doctest::Contains("model.vocab_size 256 is smaller than the byte tokenizer's 257 tokens"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {num_attention_heads: 4, num_key_value_heads: 3}\n"),
                       doctest::Contains("model.num_attention_heads 4 is not divisible by model.num_key_value_heads 3"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {hidden_size: 130, num_attention_heads: 4}\n"),
                       doctest::Contains("model.hidden_size 130 is not divisible by model.num_attention_heads 4"), Error);
  CHECK(parse(kMinimal + "model: {hidden_size: 130, num_attention_heads: 4, head_dim: 32}\n").model.head_dimension() ==
        32);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {max_position_embeddings: 64}\ntrain: {seq_len: 128}\n"),
                       doctest::Contains("train.seq_len 128 exceeds model.max_position_embeddings 64"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {eval_every: 10}\n"),
                       doctest::Contains("train.eval_every is 10 but data.val_path is none"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "checkpoint: {every_steps: 10}\n"),
                       doctest::Contains("checkpoint.every_steps is 10 but checkpoint.dir is none"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "checkpoint: {save_consolidated: true}\n"),
                       doctest::Contains("checkpoint.save_consolidated is true but checkpoint.dir is none"), Error);
}

TEST_CASE("config: quilt train starts an MPI world, or NCCL for GPU ranks, and refuses the rest naming the key") {
  // mpi is asked for by name: a CUDA build on a GPU machine would otherwise start NCCL.
  CHECK(trainer_launch_options(parse(kMinimal)).backend == WorldBackend::mpi);
  CHECK(trainer_launch_options(parse(kMinimal + "train: {device: cuda}\n")).backend == WorldBackend::mpi);
  const RecipeConfig nccl = parse(kMinimal + "dist_env: {backend: nccl}\ntrain: {device: cuda}\n");
  CHECK(trainer_launch_options(nccl).backend == WorldBackend::nccl);
  CHECK(check_recipe(nccl, 4).dp() == 4);
  // NCCL reduces GPU tensors: host training over it is refused before any world starts.
  const RecipeConfig nccl_cpu = parse(kMinimal + "dist_env: {backend: nccl}\n");
  CHECK_THROWS_WITH_AS(trainer_launch_options(nccl_cpu),
                       doctest::Contains("[config] dist_env.backend nccl reduces tensors on GPUs: it needs "
                                         "train.device: cuda"),
                       Error);
  CHECK_THROWS_WITH_AS(check_recipe(nccl_cpu, 1), doctest::Contains("dist_env.backend: mpi"), Error);
  const RecipeConfig threads = parse(kMinimal + "dist_env: {backend: threads}\n");
  CHECK_THROWS_WITH_AS(check_recipe(threads, 1),
                       doctest::Contains("[config] dist_env.backend threads runs ranks as threads of one process"),
                       Error);
}

TEST_CASE("config: train.device cuda trains a GPU per rank in every layout") {
  const RecipeConfig c = parse(kMinimal + "train: {device: cuda}\n");
  CHECK(c.train.device == TrainDevice::kCuda);
  CHECK(parse(kMinimal).train.device == TrainDevice::kCpu);
  CHECK(check_recipe(c, 1).dp() == 1);
  CHECK(check_recipe(c, 2).dp() == 2);
  CHECK(check_recipe(parse(kMinimal + "train: {device: cuda}\ndistributed: {tp_size: 2}\n"), 4).tp() == 2);
  CHECK(check_recipe(parse(kMinimal + "train: {device: cuda}\ndistributed: {strategy: ddp}\n"), 2).dp() == 2);
  CHECK(check_recipe(parse(kMinimal + "train: {device: cuda}\ndistributed: {ep_size: 2}\n"
                           "model: {num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 32}\n"),
                     2).ep() == 2);
  CHECK(check_recipe(parse(kMinimal + "train: {device: cuda}\ndistributed: {pp_size: 2}\n"), 2).pp() == 2);
  CHECK(check_recipe(parse(kMinimal + "train: {device: cuda}\ndistributed: {cp_size: 2}\n"), 2).cp() == 2);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {device: gpu}\n"), doctest::Contains("train.device"), Error);
}

TEST_CASE("config: train.cuda_graphs needs train.device cuda and a dense model, naming the keys") {
  const RecipeConfig c = parse(kMinimal + "train: {device: cuda, cuda_graphs: true}\n");
  CHECK(c.train.cuda_graphs);
  CHECK_FALSE(parse(kMinimal).train.cuda_graphs);
  CHECK(check_recipe(c, 1).dp() == 1);
  CHECK_THROWS_WITH_AS(check_recipe(c, 2),
                       doctest::Contains("[config] train.cuda_graphs captures the step of one GPU; this run has 2 "
                                         "ranks"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train: {cuda_graphs: true}\n"),
                       doctest::Contains("[config] train.cuda_graphs captures a GPU step: it needs train.device: cuda"),
                       Error);
  const RecipeConfig moe = parse(kMinimal + "train: {device: cuda, cuda_graphs: true}\n"
                                 "model: {num_experts: 4, num_experts_per_tok: 2, moe_intermediate_size: 32}\n");
  CHECK_THROWS_WITH_AS(check_recipe(moe, 1),
                       doctest::Contains("[config] train.cuda_graphs captures the step of a dense model; MoE models "
                                         "(model.num_experts 4) are not captured yet"),
                       Error);
}

TEST_CASE("config: rules that need the world size name the keys and every factor") {
  RecipeConfig c = parse(kMinimal + "train: {global_batch_size: 8, micro_batch_size: 4}\n");
  CHECK(check_recipe(c, 2).dp() == 2);
  CHECK_THROWS_WITH_AS(check_recipe(c, 4),
                       "[config] train.global_batch_size 8 is not divisible by train.micro_batch_size * dp = 4 * 4 = 16 "
                       "(micro_batch_size=4, dp_replicate=1, dp_shard=4)",
                       Error);
  CHECK_THROWS_WITH_AS(check_recipe(parse(kMinimal, {"distributed.tp_size=3"}), 3),
                       doctest::Contains("model.num_attention_heads 4 is not divisible by distributed.tp_size 3"), Error);
  CHECK_THROWS_WITH_AS(check_recipe(parse(kMinimal, {"distributed.tp_size=4", "model.num_key_value_heads=2"}), 4),
                       doctest::Contains("model.num_key_value_heads 2 is not divisible by distributed.tp_size 4"), Error);
  CHECK_THROWS_WITH_AS(check_recipe(parse(kMinimal, {"distributed.pp_size=8"}), 8),
                       doctest::Contains("distributed.pp_size 8 exceeds model.num_hidden_layers 4"), Error);
  CHECK_THROWS_WITH_AS(check_recipe(parse(kMinimal, {"distributed.pp_size=2", "train.micro_batch_size=2",
                                                     "distributed.pipeline.pp_microbatch_size=4"}),
                                    2),
                       doctest::Contains("train.micro_batch_size 2 is not divisible by "
                                         "distributed.pipeline.pp_microbatch_size 4"),
                       Error);
  CHECK_THROWS_WITH_AS(check_recipe(parse(kMinimal, {"distributed.cp_size=2", "train.seq_len=126"}), 2),
                       doctest::Contains("train.seq_len 126 is not divisible by 2 * cp_size = 4"), Error);
  CHECK_THROWS_WITH_AS(check_recipe(parse(kMinimal, {"distributed.tp_size=2"}), 3),
                       doctest::Contains("world size 3 is not divisible by tp_size * pp_size * cp_size = 2"), Error);
}

TEST_CASE("config: the smallest world a recipe allows respects HSDP and expert parallelism") {
  CHECK(default_world_size(parse(kMinimal)) == 1);
  CHECK(default_world_size(parse(kMinimal, {"distributed.tp_size=2", "distributed.pp_size=2"})) == 4);
  CHECK(default_world_size(parse(kMinimal, {"distributed.dp_replicate_size=2"})) == 4);
  CHECK(default_world_size(parse(kMinimal, {"distributed.ep_size=4", "distributed.cp_size=2"})) == 4);
  CHECK(default_world_size(parse(kMinimal, {"distributed.dp_size=3", "distributed.tp_size=2"})) == 6);
}

TEST_CASE("config: rope_parameters (or HF's rope_scaling) carry llama3 scaling") {
  RecipeConfig c = parse(kMinimal + "model:\n  rope_theta: 500000\n  rope_parameters: {rope_type: llama3, factor: 32, "
                         "low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192}\n");
  REQUIRE(c.model.rope_parameters.has_value());
  CHECK(c.model.rope_parameters->factor == 32);
  CHECK(c.model.rope_theta == 500000);
  RecipeConfig s = parse(kMinimal + "model: {rope_scaling: {rope_type: llama3, factor: 8, rope_theta: 250000}}\n");
  CHECK(s.model.rope_parameters->factor == 8);
  CHECK(s.model.rope_theta == 250000);
  CHECK_FALSE(parse(kMinimal + "model: {rope_parameters: {rope_type: default}}\n").model.rope_parameters.has_value());
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {rope_parameters: {factor: 8}, rope_scaling: {factor: 8}}\n"),
                       doctest::Contains("model.rope_parameters and model.rope_scaling are the same setting"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {rope_parameters: {low_freq_factor: 4, high_freq_factor: 1}}\n"),
                       doctest::Contains("model.rope_parameters.high_freq_factor 1 must be greater than low_freq_factor 4"),
                       Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {rope_parameters: {scale: 8}}\n"),
                       doctest::Contains("unknown key 'model.rope_parameters.scale'"), Error);
}

TEST_CASE("config: none, quoted strings, resume paths and dtype aliases read as documented") {
  RecipeConfig c = parse(kMinimal + "train: {max_grad_norm: none, param_dtype: bf16, reduce_dtype: fp32}\n"
                                    "checkpoint: {dir: ck, resume: ck/step_100}\nlogging: {dir: \"none\"}\n");
  CHECK_FALSE(c.train.max_grad_norm.has_value());
  CHECK(c.train.param_dtype == DType::bf16);
  CHECK(c.train.reduce_dtype == DType::f32);
  CHECK(c.checkpoint.resume.kind == ResumeSpec::Kind::kPath);
  CHECK(c.checkpoint.resume.path == "ck/step_100");
  CHECK(c.logging.dir == "none");  // quoted: the directory called none
  CHECK(parse(kMinimal + "checkpoint: {resume: none}\n").checkpoint.resume.kind == ResumeSpec::Kind::kNone);
  CHECK(parse(kMinimal + "distributed: {dp_size: ~}\n").distributed.dp_size == std::nullopt);
}

TEST_CASE("config: the effective recipe as YAML reads back unchanged") {
  RecipeConfig a = load_recipe(recipe_path("llama_tiny.yaml"),
                               {"train.param_dtype=bfloat16", "train.lr=3e-4", "distributed.dp_replicate_size=2",
                                "checkpoint.dir=ck", "checkpoint.resume=none", "train.max_grad_norm=none",
                                "model.rope_parameters={rope_type: llama3, factor: 8}", "logging.rank0_only=false",
                                "data.format=nanogpt", "dist_env.backend=threads", "train.decay=linear"});
  const std::string yaml = recipe_to_yaml(a);
  RecipeConfig b = parse_recipe(yaml, {}, "effective.yaml");
  CHECK(recipe_to_yaml(b) == yaml);
  CHECK(b.train.lr == a.train.lr);
  CHECK(b.train.param_dtype == DType::bf16);
  CHECK(b.distributed.dp_replicate_size == 2);
  CHECK(b.checkpoint.resume.kind == ResumeSpec::Kind::kNone);
  CHECK(b.model.rope_parameters->factor == 8);
  CHECK(b.data.format == DataFormat::kNanogpt);
  CHECK(b.dist_env.backend == Backend::kThreads);
  CHECK(yaml.find("  lr: 3e-04\n") != std::string::npos);  // shortest text that reads back exactly
  // A checkpoint literally named "auto" stays a path.
  RecipeConfig p = parse(kMinimal + "checkpoint: {resume: \"./auto\"}\n");
  p.checkpoint.resume.path = "auto";
  CHECK(parse_recipe(recipe_to_yaml(p)).checkpoint.resume.kind == ResumeSpec::Kind::kPath);
}

TEST_CASE("config: YAML syntax errors and missing files name the file") {
  CHECK_THROWS_WITH_AS(parse("train: {steps: 3\n"), doctest::Contains("test.yaml:"), Error);
  CHECK_THROWS_WITH_AS(parse("train: {steps: 3\n"), doctest::Contains("YAML syntax error"), Error);
  CHECK_THROWS_WITH_AS(load_recipe("/nonexistent/r.yaml"), "[config] cannot read recipe '/nonexistent/r.yaml'", Error);
  CHECK_THROWS_WITH_AS(load_recipe("/tmp"),
                       "[config] --config /tmp is a directory; give the recipe's YAML file (e.g. recipes/llama_tiny.yaml)",
                       Error);
}

TEST_CASE("config: load_recipe(recipe_to_yaml(cfg)) == cfg for every recipe and a non-default one") {
  const std::filesystem::path tmp = std::filesystem::temp_directory_path() / "quilt_config_roundtrip.yaml";
  std::vector<RecipeConfig> configs;
  for (const char* name : {"llama_tiny.yaml", "tp2.yaml", "hsdp2x2.yaml", "ddp2.yaml"})
    configs.push_back(load_recipe(recipe_path(name)));
  configs.push_back(parse(kMinimal, {"model.pretrained=/models/tiny", "model.head_dim=32", "train.seed=7",
                                     "logging.dir=\"none\"", "checkpoint.dir=ck", "checkpoint.resume=\"auto\"",
                                     "distributed.strategy=megatron_fsdp", "train.output_dtype=f16",
                                     "model.rope_scaling={factor: 16, rope_theta: 500000}", "data.val_path=v.bin"}));
  for (const RecipeConfig& c : configs) {
    CAPTURE(c.source);
    std::ofstream(tmp) << recipe_to_yaml(c);
    RecipeConfig back = load_recipe(tmp.string());
    CHECK(back == c);
    CHECK(recipe_to_yaml(back) == recipe_to_yaml(c));
  }
  const RecipeConfig& odd = configs.back();
  CHECK(odd.model.pretrained == "/models/tiny");
  CHECK(odd.logging.dir == "none");  // the directory called none stays a string through the round trip
  CHECK(odd.checkpoint.resume.kind == ResumeSpec::Kind::kPath);
  CHECK(odd.model.rope_theta == 500000);
  std::filesystem::remove(tmp);
  // Equality sees every key, nested ones too, and ignores where the recipe came from.
  RecipeConfig a = parse(kMinimal), b = parse_recipe(kMinimal, {}, "other.yaml");
  CHECK(a == b);
  b.distributed.moe.wrap_outer_model = false;
  CHECK_FALSE(a == b);
}

TEST_CASE("config: every key in recipe_keys() has a doc, and --set key=<its default> changes nothing") {
  const std::vector<RecipeKey> keys = recipe_keys();
  CHECK(keys.size() >= 60);
  const RecipeConfig base = parse(kMinimal);
  for (const RecipeKey& k : keys) {
    CAPTURE(k.key);
    CHECK_FALSE(k.doc.empty());
    if (k.key == "data.path") continue;  // required: its default (empty) is rejected
    CHECK(parse(kMinimal, {k.key + "=" + k.default_value}) == base);
  }
  auto has = [&](const std::string& key) {
    return std::any_of(keys.begin(), keys.end(), [&](const RecipeKey& k) { return k.key == key; });
  };
  CHECK(has("model.pretrained"));
  CHECK(has("distributed.pipeline.pp_schedule"));
  CHECK(has("distributed.moe.wrap_outer_model"));
  CHECK(has("checkpoint.resume"));
}

TEST_CASE("config: model.pretrained is a path or none and must not be empty") {
  CHECK_FALSE(parse(kMinimal).model.pretrained.has_value());
  CHECK(parse(kMinimal + "model: {pretrained: hf/llama}\n").model.pretrained == "hf/llama");
  CHECK_FALSE(parse(kMinimal + "model: {pretrained: none}\n").model.pretrained.has_value());
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {pretrained: \"\"}\n"),
                       doctest::Contains("model.pretrained: expected a directory with HF config.json"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal + "model: {pretrained: [a]}\n"),
                       doctest::Contains("model.pretrained: expected a string, got a list"), Error);
  CHECK(recipe_to_yaml(parse(kMinimal, {"model.pretrained=hf/llama"})).find("  pretrained: hf/llama\n") !=
        std::string::npos);
}

TEST_CASE("config: moe keys off their defaults warn once each that they are ignored, and pipeline keys do not") {
  CHECK(parse(kMinimal).warnings.empty());
  CHECK(load_recipe(recipe_path("llama_tiny.yaml")).warnings.empty());  // it spells out the defaults
  RecipeConfig c = parse(kMinimal, {"distributed.moe.reshard_after_forward=true",
                                    "distributed.pipeline={pp_schedule: gpipe, pp_microbatch_size: 2}",
                                    "distributed.moe.wrap_outer_model=true", "distributed.tp_size=2"});
  CHECK(c.warnings == std::vector<std::string>{
                          "[config] distributed.moe.reshard_after_forward is ignored: distributed.moe applies only "
                          "with ep_size > 1"});
  CHECK(c.distributed.moe.reshard_after_forward);  // still read and kept: only its use is missing
  CHECK(load_recipe(recipe_path("moe_tiny.yaml")).warnings.empty());
  // With expert parallelism the moe: keys are used, so nothing is said.
  CHECK(parse(kMinimal, {"distributed.moe.reshard_after_forward=true", "distributed.ep_size=2"}).warnings.empty());
  // model.mlp_only_layers is a list, also given as one --set value.
  CHECK(parse(kMinimal, {"model.mlp_only_layers=[0, 2]"}).model.mlp_only_layers == std::vector<int64_t>{0, 2});
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"model.mlp_only_layers=[a]"}), doctest::Contains("model.mlp_only_layers[0]"),
                       Error);
  // Warnings are not settings.
  CHECK(c == parse(recipe_to_yaml(c)));
}

TEST_CASE("config: model_config_mismatches names each recipe field that config.json contradicts") {
  RecipeConfig c = parse(kMinimal, {"model.pretrained=hf/tiny", "model.num_key_value_heads=2"});
  const std::string agreeing = R"({"model_type": "llama", "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "rope_scaling": null, "vocab_size": 320, "tie_word_embeddings": false,
    "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "head_dim": 32})";
  CHECK(model_config_mismatches(c.model, agreeing).empty());  // head_dim is none in the recipe: not compared
  CHECK(model_config_mismatches(c.model, "{}").empty());      // keys config.json lacks are not compared
  const std::string differing = R"({"hidden_size": 64, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": true, "vocab_size": 320})";
  CHECK(model_config_mismatches(c.model, differing) ==
        std::vector<std::string>{"model.hidden_size is 128 in the recipe but 64 in hf/tiny/config.json",
                                 "model.num_key_value_heads is 2 in the recipe but 4 in hf/tiny/config.json",
                                 "model.rms_norm_eps is 1e-05 in the recipe but 1e-06 in hf/tiny/config.json",
                                 "model.tie_word_embeddings is false in the recipe but true in hf/tiny/config.json"});
  // rope: HF v5 keeps rope_theta inside rope_parameters; older files say rope_scaling and `type`.
  RecipeConfig r = parse(kMinimal, {"model.pretrained=hf/l3", "model.rope_theta=500000",
                                    "model.rope_parameters={rope_type: llama3, factor: 32}"});
  CHECK(model_config_mismatches(r.model, R"({"rope_parameters": {"rope_type": "llama3", "factor": 32.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0}})").empty());
  CHECK(model_config_mismatches(r.model, R"({"rope_theta": 10000, "rope_scaling": {"type": "llama3", "factor": 8}})") ==
        std::vector<std::string>{"model.rope_theta is 5e+05 in the recipe but 10000 in hf/l3/config.json",
                                 "model.rope_parameters.factor is 32 in the recipe but 8 in hf/l3/config.json"});
  CHECK(model_config_mismatches(r.model, R"({"rope_scaling": null})") ==
        std::vector<std::string>{"model.rope_parameters is {rope_type: llama3, factor: 32, low_freq_factor: 1, "
                                 "high_freq_factor: 4, original_max_position_embeddings: 8192} in the recipe but "
                                 "none in hf/l3/config.json"});
  // A rope_parameters the recipe leaves none is config.json's to decide.
  CHECK(model_config_mismatches(c.model, R"({"rope_scaling": {"rope_type": "llama3", "factor": 8}})").empty());
  // A value the recipe could not even hold is a mismatch too, with the reason.
  std::vector<std::string> yarn = model_config_mismatches(r.model, R"({"rope_scaling": {"rope_type": "yarn"}})");
  REQUIRE(yarn.size() == 1);
  CHECK(yarn[0].find("model.rope_parameters is {rope_type: llama3") == 0);
  CHECK(yarn[0].find("expected one of default | llama3, got 'yarn'") != std::string::npos);
  CHECK_THROWS_WITH_AS(model_config_mismatches(c.model, "{not json"),
                       doctest::Contains("hf/tiny/config.json is not valid JSON"), Error);
}

TEST_CASE("config: packing needs one row per micro-batch, rows of train.seq_len and sizes cp can split") {
  const std::vector<std::string> pack = {"packed_sequence.packed_sequence_size=64", "train.seq_len=64",
                                         "train.micro_batch_size=1"};
  CHECK(parse(kMinimal).packed_sequence.packed_sequence_size == 0);
  CHECK(check_recipe(parse(kMinimal, pack), 2).dp() == 2);
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> all = pack;
    all.insert(all.end(), more.begin(), more.end());
    return parse(kMinimal, all);
  };
  CHECK_THROWS_WITH_AS(check_recipe(with({"train.micro_batch_size=2"}), 1),
                       "[config] train.micro_batch_size must be 1 with packing (packed_sequence.packed_sequence_size "
                       "64), got 2",
                       Error);
  CHECK_THROWS_WITH_AS(check_recipe(with({"train.seq_len=128"}), 1),
                       "[config] train.seq_len 128 differs from packed_sequence.packed_sequence_size 64: packed rows "
                       "are train.seq_len tokens; set both to 64",
                       Error);
  CHECK_THROWS_WITH_AS(check_recipe(with({"packed_sequence.packed_sequence_size=36", "train.seq_len=36",
                                          "distributed.cp_size=4"}),
                                    4),
                       "[config] packed_sequence.packed_sequence_size 36 is not divisible by 2 * cp_size = 8 "
                       "(cp_size=4; context parallelism splits each document into 2 * cp_size load-balanced chunks)",
                       Error);
  CHECK(check_recipe(with({"distributed.cp_size=2"}), 2).cp() == 2);  // 64 splits into 4 chunks
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"packed_sequence.packed_sequence_size=-1"}),
                       doctest::Contains("packed_sequence.packed_sequence_size must be >= 0, got -1"), Error);
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"packed_sequence.size=64"}),
                       doctest::Contains("unknown key 'packed_sequence.size'"), Error);
  // The document multiple: 2 * cp_size by default under cp, 1 without; a set one must fit cp.
  CHECK(packing_document_multiple(with({})) == 1);
  CHECK(packing_document_multiple(with({"distributed.cp_size=2"})) == 4);
  CHECK(packing_document_multiple(with({"packed_sequence.document_multiple=8"})) == 8);
  CHECK(check_recipe(with({"distributed.cp_size=2", "packed_sequence.document_multiple=8"}), 2).cp() == 2);
  CHECK_THROWS_WITH_AS(check_recipe(with({"distributed.cp_size=2", "packed_sequence.document_multiple=6"}), 2),
                       "[config] packed_sequence.document_multiple 6 is not a multiple of 2 * cp_size = 4 (cp_size=2; "
                       "context parallelism splits each document into 2 * cp_size load-balanced chunks)",
                       Error);
  CHECK_THROWS_WITH_AS(check_recipe(with({"packed_sequence.document_multiple=48"}), 1),
                       "[config] packed_sequence.document_multiple 48 does not divide packed_sequence.packed_sequence_size 64",
                       Error);
}

TEST_CASE("config: distributed.cp_comm_type takes ring or all_gather or a2a, and a2a needs heads cp can cut") {
  CHECK(parse(kMinimal).distributed.cp_comm_type == "ring");
  CHECK(parse(kMinimal, {"distributed.cp_comm_type=a2a"}).distributed.cp_comm_type == "a2a");
  CHECK_THROWS_WITH_AS(parse(kMinimal, {"distributed.cp_comm_type=ulysses"}),
                       doctest::Contains("distributed.cp_comm_type"), Error);
  const std::vector<std::string> heads = {"model.num_attention_heads=8", "model.num_key_value_heads=2",
                                          "model.hidden_size=64", "distributed.cp_comm_type=a2a"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> all = heads;
    all.insert(all.end(), more.begin(), more.end());
    return parse(kMinimal, all);
  };
  CHECK(check_recipe(with({"distributed.cp_size=2"}), 2).cp() == 2);
  CHECK_THROWS_WITH_AS(check_recipe(with({"distributed.cp_size=4"}), 4),
                       "[config] distributed.cp_comm_type a2a cuts the heads over cp_size 4: model.num_attention_heads 8 "
                       "and model.num_key_value_heads 2 per tp rank (tp_size=1: 8 and 2) must both be divisible by 4 "
                       "(or use cp_comm_type ring or all_gather)",
                       Error);
  CHECK_THROWS_WITH_AS(check_recipe(with({"distributed.cp_size=2", "distributed.tp_size=2"}), 4),
                       doctest::Contains("per tp rank (tp_size=2: 4 and 1) must both be divisible by 2"), Error);
  // ring and all_gather cut no heads.
  CHECK(check_recipe(with({"distributed.cp_size=4", "distributed.cp_comm_type=ring"}), 4).cp() == 4);
  CHECK(check_recipe(with({"distributed.cp_size=2", "distributed.tp_size=2", "distributed.cp_comm_type=all_gather"}), 4)
            .cp() == 2);
}
