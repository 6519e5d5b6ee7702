// Training recipes: the YAML file `quilt train --config FILE` reads, as plain structs.
//
// A recipe has the sections model:, data:, packed_sequence:, train:, distributed:, dist_env:,
// checkpoint: and logging:. Every key has a default, so a recipe names only what it changes. Command-line
// overrides ("train.steps=20") are applied to the YAML tree before it is parsed, so they are
// checked exactly like the file. Any unknown key, wrong type or bad value throws quilt::Error
// naming the full dotted key (and, for unknown keys, the valid keys of that section) before
// any rank starts work.
//
//   RecipeConfig cfg = load_recipe("recipes/llama_tiny.yaml", {"train.steps=20"});
//   ParallelDims dims = check_recipe(cfg, /*world_size=*/4);   // cross-section rules
//   std::cout << recipe_to_yaml(cfg);                           // the effective recipe
//
// Each section's keys are declared once, in a table in config.cpp that drives parsing,
// validation messages, recipe_to_yaml, equality and recipe_keys().
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "collectives/launch.h"
#include "kernels/dtype.h"
#include "parallel/parallel_dims.h"

namespace quilt {

/// model.rope_parameters: RoPE frequency scaling (HF's rope_scaling / rope_parameters).
struct RopeParameters {
  std::string rope_type = "llama3";  // default | llama3
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

/// model: a decoder described with Hugging Face config.json names.
struct ModelConfig {
  std::string model_type = "llama";  // llama | qwen3 | qwen3_moe
  int64_t hidden_size = 128;
  int64_t intermediate_size = 384;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  std::optional<int64_t> num_key_value_heads;  // none: num_attention_heads (no GQA)
  std::optional<int64_t> head_dim;             // none: hidden_size / num_attention_heads
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  std::optional<RopeParameters> rope_parameters;  // none: plain RoPE
  int64_t vocab_size = 320;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 2048;
  double initializer_range = 0.02;
  std::optional<std::string> pretrained;  // none: random init; else a dir with HF config.json + model.safetensors
  std::optional<bool> qk_norm;            // none: as model_type has it (qwen3*: true)
  // Mixture of experts (Qwen3-MoE names, DeepSeek-V3 router options); num_experts 0: dense.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 2;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  int64_t first_k_dense_replace = 0;
  std::string scoring_func = "softmax";   // softmax | sigmoid
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  int64_t n_shared_experts = 0;
  bool score_correction_bias = false;     // e_score_correction_bias (on with load_balance_coeff)
  double load_balance_coeff = 0.0;        // aux-loss-free balancing step per optimizer step; 0: off
  double router_aux_loss_coef = 0.0;      // sequence-level balance loss; 0: off

  /// num_key_value_heads, or num_attention_heads when it is none.
  int64_t kv_heads() const { return num_key_value_heads.value_or(num_attention_heads); }
  /// head_dim, or hidden_size / num_attention_heads when it is none.
  int64_t head_dimension() const { return head_dim.value_or(hidden_size / num_attention_heads); }
  /// Parameters of a decoder of this shape (embedding, layers with their dense or MoE MLPs,
  /// final norm, untied head).
  int64_t num_parameters() const;
  /// True when decoder layer `layer` has an MoE MLP (the rule of LlamaConfig::is_sparse_layer).
  bool is_sparse_layer(int64_t layer) const;
};

/// How token shards are laid out on disk.
enum class DataFormat {
  kLlmc,     // llm.c: 256 x int32 header (magic, version, token count), then uint16 or uint32 tokens
  kNanogpt,  // nanoGPT: raw uint16 tokens, no header
};
/// "llmc" or "nanogpt".
const char* data_format_name(DataFormat f);

/// data: where the token shards are.
struct DataConfig {
  std::string path;                     // a directory of *.bin shards, a glob, or one file (relative: to the cwd)
  std::optional<std::string> val_path;  // none: no validation
  std::string tokenizer = "byte";
  DataFormat format = DataFormat::kLlmc;
};

/// packed_sequence: rows made of whole documents (sequence packing) instead of windows of the
/// token stream; positions restart and attention stays within each document.
struct PackedSequenceConfig {
  int64_t packed_sequence_size = 0;  // tokens per packed row (must equal train.seq_len); 0: no packing
  // Each document padded to a multiple of this; 0: 2 * cp_size under context parallelism, 1
  // otherwise. Under cp it must be a multiple of 2 * cp_size (each document is cut in 2 * cp chunks).
  int64_t document_multiple = 0;
};

/// How the learning rate falls after warm-up.
enum class Decay { kCosine, kLinear };
/// "cosine" or "linear".
const char* decay_name(Decay d);

/// Where a run's model, gradients, optimizer state and batches live.
enum class TrainDevice { kCpu, kCuda };
/// "cpu" or "cuda".
const char* train_device_name(TrainDevice d);

/// train: the optimisation loop (AdamW with warm-up and decay).
struct TrainConfig {
  int64_t steps = 100;
  int64_t global_batch_size = 8;  // sequences per optimizer step, over all data-parallel ranks
  int64_t micro_batch_size = 1;   // sequences per rank per forward/backward
  int64_t seq_len = 128;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 10;       // may exceed steps (short smoke runs): lr then never peaks
  Decay decay = Decay::kCosine;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  std::optional<double> max_grad_norm = 1.0;  // none: no clipping
  int64_t seed = 1234;
  DType dtype = DType::f32;              // master weights and optimizer state
  std::optional<DType> param_dtype;      // none: dtype (compute dtype of parameters)
  std::optional<DType> reduce_dtype;     // none: dtype (gradient reduction dtype)
  std::optional<DType> output_dtype;     // none: dtype (dtype of module outputs)
  int64_t eval_every = 0;                // 0: never
  int64_t eval_steps = 10;               // global batches per evaluation
  int64_t max_skipped_steps = 5;         // consecutive non-finite steps that stop the run; 0: never
  TrainDevice device = TrainDevice::kCpu;  // cuda: one GPU, one rank (the first device)
  bool cuda_graphs = false;                // cuda: capture the step once, then replay it

  /// Gradient-accumulation micro-steps per optimizer step for `dp` data-parallel ranks.
  int64_t accumulation_steps(int64_t dp) const { return global_batch_size / (micro_batch_size * dp); }
};

/// Parses a dtype name: float32/fp32/f32, bfloat16/bf16, float16/fp16/f16, float64/fp64/f64.
std::optional<DType> parse_float_dtype(const std::string& s);
/// The recipe spelling of a floating dtype: "float32", "bfloat16", "float16", "float64".
const char* float_dtype_name(DType d);

/// Communication backend of the run.
enum class Backend { kMpi, kNccl, kThreads };
/// "mpi", "nccl" or "threads".
const char* backend_name(Backend b);

/// dist_env: how ranks talk.
struct DistEnvConfig {
  Backend backend = Backend::kMpi;
  double timeout_s = 300.0;  // a collective that takes longer aborts the job, naming rank and op
};

/// checkpoint.resume: start fresh, continue from the newest checkpoint in dir, or load a path.
struct ResumeSpec {
  enum class Kind { kAuto, kNone, kPath };
  Kind kind = Kind::kAuto;
  std::string path;  // kPath only
};

/// checkpoint: sharded checkpoints every so many steps.
struct CheckpointConfig {
  std::optional<std::string> dir;  // none: no checkpoints
  int64_t every_steps = 0;         // 0: only at the end (when dir is set)
  int64_t keep_last = 0;           // 0: keep all
  ResumeSpec resume;
  bool save_consolidated = false;  // also write HF-compatible safetensors at the end
};

/// logging: metrics lines and files.
struct LoggingConfig {
  std::optional<std::string> dir;  // none: stdout only
  int64_t every_steps = 10;
  bool rank0_only = true;
  bool trace = false;                 // a Chrome/Perfetto trace of the steps below (ops, collectives, ...)
  std::vector<int64_t> trace_steps{2};  // which steps logging.trace records
  bool tensorboard = false;           // a TensorBoard events file of the step scalars in dir
};

/// A whole recipe.
struct RecipeConfig {
  ModelConfig model;
  DataConfig data;
  PackedSequenceConfig packed_sequence;
  TrainConfig train;
  DistributedConfig distributed;
  DistEnvConfig dist_env;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  std::string source;                 // file it came from ("<string>" for parse_recipe)
  std::vector<std::string> warnings;  // settings read but not used yet, one line per key
};

/// Every setting equal (source and warnings are not settings).
bool operator==(const RecipeConfig& a, const RecipeConfig& b);

/// One recipe key: its dotted name, its default as YAML text, and what it means.
struct RecipeKey {
  std::string key, default_value, doc;
};
/// Every key a recipe may set, in recipe_to_yaml's order (map-valued defaults are listed by their leaves).
std::vector<RecipeKey> recipe_keys();

/// Reads a recipe file and applies "a.b.c=value" overrides; throws naming the key on any error.
/// Logs each of the returned config's warnings (rank 0 only, via log_line).
RecipeConfig load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});
/// Parses recipe text (tests, embedded recipes); `source` names it in errors.
RecipeConfig parse_recipe(const std::string& yaml_text, const std::vector<std::string>& overrides = {},
                          const std::string& source = "<string>");
/// The effective recipe as YAML (every key, defaults included); parse_recipe reads it back unchanged.
std::string recipe_to_yaml(const RecipeConfig& cfg);

/// Rules that tie sections together or need the world size (batch vs data-parallel degree,
/// sequence length vs context parallelism, heads vs tensor parallelism, ...). Returns the
/// validated ParallelDims; throws naming the keys involved.
ParallelDims check_recipe(const RecipeConfig& cfg, int64_t world_size);
/// How the trainer starts its world for dist_env.backend: mpi is MPI through host memory (also
/// for GPU tensors, staged); nccl (with train.device cuda) is NCCL with a GPU per rank; threads is
/// refused naming the key, as is nccl with train.device cpu.
LaunchOptions trainer_launch_options(const RecipeConfig& cfg);
/// One message per model field that the recipe sets and HF config.json (its text) contradicts,
/// e.g. "model.hidden_size is 128 in the recipe but 64 in <model.pretrained>/config.json".
/// Fields config.json lacks, and optional fields the recipe leaves none, are not compared.
std::vector<std::string> model_config_mismatches(const ModelConfig& recipe, const std::string& hf_config_json_text);

/// The multiple packing pads each document to: packed_sequence.document_multiple, or by default
/// 2 * cp_size under context parallelism and 1 otherwise.
int64_t packing_document_multiple(const RecipeConfig& cfg);

/// Smallest world size the recipe can run on: dp_size (or 1) * tp_size * pp_size * cp_size.
int64_t default_world_size(const RecipeConfig& cfg);

}  // namespace quilt
