// Llama-style decoder (token embedding, RMSNorm, rotary embeddings with optional llama3
// scaling, grouped-query attention, SwiGLU MLP, optional tied embeddings), configured by the
// fields of a HF config.json and named as HF names its weights, so checkpoints interchange.
//
//   LlamaConfig cfg = LlamaConfig::from_json(json_text);
//   auto model = std::make_shared<LlamaForCausalLM>(cfg);
//   model->init_weights(seed);                       // same values in every layout
//   Tensor loss = model->loss(inputs, targets);      // inputs/targets (B, T) i64
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/nn/layers.h"
#include "dtensor/placement.h"
#include "engine/nn/module.h"

namespace quilt {

/// llama3 frequency scaling of RoPE (HF "rope_scaling"/"rope_parameters" with rope_type llama3).
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

/// The HF config.json fields the model reads.
struct LlamaConfig {
  int64_t hidden_size = 128;
  int64_t intermediate_size = 384;
  int64_t num_hidden_layers = 4;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 32;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;
  int64_t vocab_size = 320;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 2048;
  double initializer_range = 0.02;

  /// Parses HF config.json text; unknown fields are ignored, missing ones keep defaults.
  static LlamaConfig from_json(const std::string& text);
  /// HF config.json text (architectures, model_type, and the fields above).
  std::string to_json() const;
  /// Throws naming the field when the shape is inconsistent (heads, head_dim, ...).
  void validate() const;
};

/// Rotary tables (cos, sin), each (max_positions, head_dim / 2), in f32.
std::pair<Tensor, Tensor> rope_tables(const LlamaConfig& cfg, int64_t max_positions);

class LlamaAttention : public Module {
 public:
  explicit LlamaAttention(const LlamaConfig& cfg);
  /// x (B, T, C) with rotary tables (T, D/2) -> (B, T, C), causal.
  Tensor forward_rope(const Tensor& x, const Tensor& cos, const Tensor& sin);
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;

 private:
  int64_t heads_, kv_heads_, head_dim_;
};

class LlamaMLP : public Module {
 public:
  explicit LlamaMLP(const LlamaConfig& cfg);
  Tensor forward(const Tensor& x) override;
  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
};

class LlamaDecoderLayer : public Module {
 public:
  explicit LlamaDecoderLayer(const LlamaConfig& cfg);
  /// One block; the rotary tables for this sequence length are set by the model before the call.
  Tensor forward(const Tensor& x) override;
  void set_rope(Tensor cos, Tensor sin) { cos_ = std::move(cos); sin_ = std::move(sin); }
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMLP> mlp;
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;

 private:
  Tensor cos_, sin_;
};

class LlamaModel : public Module {
 public:
  explicit LlamaModel(const LlamaConfig& cfg);
  /// tokens (B, T) -> hidden states (B, T, C).
  Tensor forward(const Tensor& tokens) override;
  std::shared_ptr<Embedding> embed_tokens;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<RMSNorm> norm;
  /// The decoder blocks (each one FSDP unit / activation-checkpoint region).
  std::vector<std::shared_ptr<LlamaDecoderLayer>> blocks;
  /// Applied to the embedding output (sequence parallelism lays the residual stream out here).
  std::function<Tensor(const Tensor&)> after_embedding;
  /// Wraps each block's forward (activation checkpointing installs itself here).
  std::function<Tensor(LlamaDecoderLayer&, const Tensor&)> block_runner;

 private:
  LlamaConfig cfg_;
};

class LlamaForCausalLM : public Module {
 public:
  explicit LlamaForCausalLM(const LlamaConfig& cfg);
  /// tokens (B, T) -> logits (B, T, V).
  Tensor forward(const Tensor& tokens) override;
  /// Mean next-token cross entropy of logits(inputs) against targets (B, T).
  Tensor loss(const Tensor& inputs, const Tensor& targets);
  const LlamaConfig& config() const { return cfg_; }
  /// The model's tensor-parallel plan (the layout of a parameter on the "tp" axis), as
  /// torchtitan's Llama plan: q/k/v/gate/up colwise (Shard(0) of (out, in)), o/down rowwise
  /// (Shard(1)), the embedding vocab-parallel (Shard(0)), lm_head colwise over the vocabulary
  /// (loss-parallel logits), norms replicated.
  static Placement tp_placement(const std::string& param_name);
  /// FLOPs of one forward+backward per token (6N + attention), for MFU.
  double flops_per_token(int64_t seq_len) const;
  std::shared_ptr<LlamaModel> model;
  std::shared_ptr<Linear> lm_head;  // null when tied to the embedding

 private:
  LlamaConfig cfg_;
};

/// Loads HF-named weights (one model.safetensors, or a model.safetensors.index.json with its
/// shards) into `model`'s parameters in place, whatever their layout (each rank reads only its
/// blocks). Throws naming the missing tensor or the shape that differs.
void load_hf_weights(Module& model, const std::string& path);

}  // namespace quilt
