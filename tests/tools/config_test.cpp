// Recipes: parsing, overrides, unknown keys, value rules, cross-section rules, YAML round trip.
#include <doctest/doctest.h>

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
                       doctest::Contains("unknown key 'trian' (test.yaml:2); valid keys: model, data, train"), Error);
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
  CHECK_THROWS_WITH_AS(parse(kMinimal + "train:\n  steps: 0\n"),
                       "[config] train.steps must be >= 1, got 0 (test.yaml:3)", Error);
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
}
