// Llama-style decoder (token embedding, RMSNorm, rotary embeddings with optional llama3
// scaling, grouped-query attention, SwiGLU MLP, optional tied embeddings), configured by the
// fields of a HF config.json and named as HF names its weights, so checkpoints interchange.
// The same decoder is Qwen3 (RMSNorm of each head's queries and keys: qk_norm) and Qwen3-MoE
// (some layers' MLP a mixture of experts, models/moe), with DeepSeek-V3's router options.
// A model may be one pipeline stage: it holds decoder layers [first, end) under their global
// indices ("model.layers.4..."), and the embedding and the final norm + head only if asked.
//
//   LlamaConfig cfg = LlamaConfig::from_json(json_text);
//   auto model = std::make_shared<LlamaForCausalLM>(cfg);
//   model->init_weights(seed);                        // same values in every layout
//   Tensor pos = arange(0, T);                        // (T) or (B, T) i64
//   Tensor logits = (*model)(tokens, pos);            // tokens (B, T) i64 -> (B, T, V)
//   LlamaForCausalLM first(cfg, {.first_layer = 0, .end_layer = 2, .head = false});
//   LlamaForCausalLM last(cfg, {.first_layer = 2, .embed = false});
//   Tensor same = last(first(tokens, pos), pos);      // hidden (B, T, C) between stages
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "models/moe/moe.h"

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
  std::string model_type = "llama";  // llama | qwen3 | qwen3_moe (HF's model_type)
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
  bool qk_norm = false;  // RMSNorm over head_dim of q and k before RoPE (Qwen3: true)

  // Mixture of experts (Qwen3-MoE names, with DeepSeek-V3's router options); num_experts 0: dense.
  int64_t num_experts = 0;              // HF num_experts (Qwen3-MoE) or n_routed_experts (DeepSeek-V3)
  int64_t num_experts_per_tok = 2;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;      // layer i is sparse when (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers; // ... and i is not listed here ...
  int64_t first_k_dense_replace = 0;    // ... and i >= this
  std::string scoring_func = "softmax"; // softmax | sigmoid
  int64_t n_group = 1;
  int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  int64_t n_shared_experts = 0;
  bool score_correction_bias = false;   // HF topk_method "noaux_tc": e_score_correction_bias
  double load_balance_coeff = 0.0;      // aux-loss-free balancing step (training; not an HF field)
  double router_aux_loss_coef = 0.0;    // sequence-level balance loss weight

  /// True when decoder layer `layer` has a mixture-of-experts MLP.
  bool is_sparse_layer(int64_t layer) const;
  /// The options of this config's MoE blocks.
  MoeOptions moe_options() const;
  /// Multiply-accumulates per token in decoder layer `layer`'s forward: the attention
  /// projections, causal attention over seq_len, and the MLP (or the router, the k routed
  /// experts a token visits and the shared ones). The pipeline split weighs stages by it.
  double layer_macs_per_token(int64_t layer, int64_t seq_len) const;
  /// The same for the lm_head (the final norm and the embedding lookup cost next to nothing).
  double head_macs_per_token() const { return double(hidden_size) * double(vocab_size); }

  /// Parses HF config.json text; unknown fields are ignored, missing ones keep defaults.
  static LlamaConfig from_json(const std::string& text);
  /// HF config.json text (architectures, model_type, and the fields above).
  std::string to_json() const;
  /// Throws naming the field when the shape is inconsistent (heads, head_dim, ...).
  void validate() const;
};

/// Rotary tables (cos, sin), each (max_positions, head_dim / 2), in f64 (rounded to the
/// activations' dtype where they are used).
std::pair<Tensor, Tensor> rope_tables(const LlamaConfig& cfg, int64_t max_positions);

/// The part of the model one pipeline stage holds: decoder layers [first_layer, end_layer)
/// (global indices; end_layer -1 means num_hidden_layers), the token embedding, and the final
/// norm with the lm_head. The default is the whole model.
struct LlamaStage {
  int64_t first_layer = 0;
  int64_t end_layer = -1;
  bool embed = true;
  bool head = true;
};

/// The attention of a layer: q (B, Hq, T, D), k and v (B, Hkv, T, D) after RoPE, with the
/// tokens' positions ((T) or (B, T) integers) and, for packed rows, their documents ((B, T)
/// integers, or undefined) -> (B, Hq, T, D), causal within each document. Context parallelism
/// installs its own (the tokens here are then this rank's chunks of the sequence).
using AttentionFn = std::function<Tensor(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                                         const Tensor& document_ids)>;

/// Causal attention on this rank alone, per document when `document_ids` is defined.
Tensor local_causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                              const Tensor& document_ids);

class LlamaAttention : public Module {
 public:
  explicit LlamaAttention(const LlamaConfig& cfg);
  /// x (B, T, C) with rotary tables broadcastable to (B, H, T, D/2), the tokens' positions and
  /// documents (undefined: one document per row) -> (B, T, C), causal; through the module's
  /// hooks, which see all five inputs.
  Tensor operator()(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                    const Tensor& document_ids);
  using Module::operator();
  /// The computation of operator() without the hooks.
  Tensor forward_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                      const Tensor& document_ids);
  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<RMSNorm> q_norm, k_norm;  // qk_norm only
  AttentionFn attention = local_causal_attention;

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
  /// Decoder layer `layer` (its MLP is an MoE when cfg.is_sparse_layer(layer)).
  LlamaDecoderLayer(const LlamaConfig& cfg, int64_t layer);
  /// One block: x (B, T, C) with rotary tables broadcastable to (B, H, T, D/2), the tokens'
  /// positions and documents (see LlamaAttention), through the module's hooks and forward
  /// wrapper (which see all five inputs).
  Tensor operator()(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                    const Tensor& document_ids);
  using Module::operator();
  /// The computation of operator() without the hooks.
  Tensor forward_block(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                       const Tensor& document_ids);
  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<Module> mlp;  // LlamaMLP, or MoE in a sparse layer
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
};

class LlamaModel : public Module {
 public:
  explicit LlamaModel(const LlamaConfig& cfg, const LlamaStage& stage = {});
  /// tokens (B, T) i64 (when the embedding is held) or hidden states (B, T, C), at `positions`
  /// (T) or (B, T) i64 -> hidden states (B, T, C), normed when the final norm is held.
  /// `document_ids` (B, T) integers: attention stays within each document (packed rows).
  Tensor operator()(const Tensor& x, const Tensor& positions, const Tensor& document_ids = {});
  using Module::operator();
  /// The computation of operator() without the hooks.
  Tensor forward(const Tensor& x, const Tensor& positions, const Tensor& document_ids = {});
  /// forward(x, positions 0..T-1).
  Tensor forward(const Tensor& x) override;
  /// The rotary tables (cos, sin) at `positions`: (T, D/2) for (T), (B, 1, T, D/2) for (B, T).
  std::pair<Tensor, Tensor> rope(const Tensor& positions);
  /// Global indices of the decoder layers held, in order.
  std::vector<int64_t> layer_indices() const;

  std::shared_ptr<Embedding> embed_tokens;  // null when the stage holds no embedding
  std::shared_ptr<ModuleDict> layers;       // LlamaDecoderLayer by global index "0".."L-1"
  std::shared_ptr<RMSNorm> norm;            // null when the stage holds no head

 private:
  LlamaConfig cfg_;
};

class LlamaForCausalLM : public Module {
 public:
  /// The whole model, or the part `stage` names (throws naming the field when it is out of
  /// range, or when tied embeddings would put the head on a stage without the embedding).
  explicit LlamaForCausalLM(const LlamaConfig& cfg, const LlamaStage& stage = {});
  /// tokens (B, T) i64 or hidden (B, T, C) at `positions` (T) or (B, T) i64 -> logits (B, T, V)
  /// when the head is held, else hidden states (B, T, C); through the module's hooks.
  /// `document_ids` (B, T) integers: attention stays within each document (packed rows).
  Tensor operator()(const Tensor& x, const Tensor& positions, const Tensor& document_ids = {});
  using Module::operator();
  /// The computation of operator() without the hooks.
  Tensor forward(const Tensor& x, const Tensor& positions, const Tensor& document_ids = {});
  /// forward(x, positions 0..T-1).
  Tensor forward(const Tensor& x) override;
  const LlamaConfig& config() const { return cfg_; }
  /// The layers and ends this model holds (end_layer resolved).
  const LlamaStage& stage() const { return stage_; }
  bool has_embedding() const { return model->embed_tokens != nullptr; }
  bool has_head() const { return model->norm != nullptr; }
  /// FLOPs of one forward+backward per token (6N + attention) of the parameters and layers held, for MFU.
  double flops_per_token(int64_t seq_len) const;
  std::shared_ptr<LlamaModel> model;
  std::shared_ptr<Linear> lm_head;  // null when tied to the embedding or when the stage holds no head

 private:
  LlamaConfig cfg_;
  LlamaStage stage_;
};

/// Loads HF-named weights (one model.safetensors, or a model.safetensors.index.json with its
/// shards) into `model`'s parameters and persistent buffers in place, whatever their layout
/// (each rank reads only its blocks); grouped experts are read from HF's per-expert tensors.
/// Throws naming the missing tensor (or expert) or the shape that differs.
void load_hf_weights(Module& model, const std::string& path);

}  // namespace quilt
