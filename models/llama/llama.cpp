// Llama decoder: see llama.h.
#include "models/llama/llama.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include "dtensor/checkpoint.h"
#include "dtensor/dtensor.h"
#include "engine/engine.h"

namespace quilt {

LlamaConfig LlamaConfig::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    fail("[llama config] config.json is not valid JSON: ", e.what());
  }
  LlamaConfig c;
  auto get = [&](const char* key, auto& field) {
    if (j.contains(key) && !j[key].is_null()) {
      try {
        field = j[key].get<std::decay_t<decltype(field)>>();
      } catch (const std::exception&) {
        fail("[llama config] field '", key, "' has the wrong type: ", j[key].dump());
      }
    }
  };
  get("hidden_size", c.hidden_size);
  get("intermediate_size", c.intermediate_size);
  get("num_hidden_layers", c.num_hidden_layers);
  get("num_attention_heads", c.num_attention_heads);
  c.num_key_value_heads = c.num_attention_heads;
  get("num_key_value_heads", c.num_key_value_heads);
  c.head_dim = c.hidden_size / std::max<int64_t>(1, c.num_attention_heads);
  get("head_dim", c.head_dim);
  get("rms_norm_eps", c.rms_norm_eps);
  get("rope_theta", c.rope_theta);
  get("vocab_size", c.vocab_size);
  get("tie_word_embeddings", c.tie_word_embeddings);
  get("max_position_embeddings", c.max_position_embeddings);
  get("initializer_range", c.initializer_range);
  get("model_type", c.model_type);
  QUILT_CHECK(c.model_type == "llama" || c.model_type == "qwen3" || c.model_type == "qwen3_moe",
              "[llama config] model_type '", c.model_type, "' is not supported (llama, qwen3, qwen3_moe)");
  c.qk_norm = c.model_type != "llama";
  get("qk_norm", c.qk_norm);
  get("n_routed_experts", c.num_experts);
  get("num_experts", c.num_experts);
  get("num_experts_per_tok", c.num_experts_per_tok);
  get("moe_intermediate_size", c.moe_intermediate_size);
  get("norm_topk_prob", c.norm_topk_prob);
  get("decoder_sparse_step", c.decoder_sparse_step);
  get("mlp_only_layers", c.mlp_only_layers);
  get("first_k_dense_replace", c.first_k_dense_replace);
  get("scoring_func", c.scoring_func);
  get("n_group", c.n_group);
  get("topk_group", c.topk_group);
  get("routed_scaling_factor", c.routed_scaling_factor);
  get("n_shared_experts", c.n_shared_experts);
  std::string topk_method;
  get("topk_method", topk_method);
  c.score_correction_bias = topk_method == "noaux_tc";
  // HF applies its router loss only when output_router_logits is set.
  bool router_logits = false;
  get("output_router_logits", router_logits);
  if (router_logits) get("router_aux_loss_coef", c.router_aux_loss_coef);
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    const auto& r = j[key];
    const std::string type = r.value("rope_type", r.value("type", std::string("default")));
    if (type == "default") continue;
    QUILT_CHECK(type == "llama3", "[llama config] ", key, ".rope_type '", type, "' is not supported (llama3 or default)");
    RopeScaling s;
    s.factor = r.value("factor", s.factor);
    s.low_freq_factor = r.value("low_freq_factor", s.low_freq_factor);
    s.high_freq_factor = r.value("high_freq_factor", s.high_freq_factor);
    s.original_max_position_embeddings = r.value("original_max_position_embeddings", s.original_max_position_embeddings);
    if (r.contains("rope_theta")) c.rope_theta = r["rope_theta"].get<double>();
    c.rope_scaling = s;
  }
  c.validate();
  return c;
}

std::string LlamaConfig::to_json() const {
  const char* arch = model_type == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                     : model_type == "qwen3"   ? "Qwen3ForCausalLM"
                                               : "LlamaForCausalLM";
  nlohmann::json j = {{"architectures", {arch}},
                      {"model_type", model_type},
                      {"hidden_size", hidden_size},
                      {"intermediate_size", intermediate_size},
                      {"num_hidden_layers", num_hidden_layers},
                      {"num_attention_heads", num_attention_heads},
                      {"num_key_value_heads", num_key_value_heads},
                      {"head_dim", head_dim},
                      {"rms_norm_eps", rms_norm_eps},
                      {"rope_theta", rope_theta},
                      {"vocab_size", vocab_size},
                      {"tie_word_embeddings", tie_word_embeddings},
                      {"max_position_embeddings", max_position_embeddings},
                      {"initializer_range", initializer_range},
                      {"hidden_act", "silu"},
                      {"torch_dtype", "float32"}};
  j["qk_norm"] = qk_norm;
  if (num_experts > 0) {
    j["num_experts"] = num_experts;
    j["num_experts_per_tok"] = num_experts_per_tok;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
    j["first_k_dense_replace"] = first_k_dense_replace;
    j["scoring_func"] = scoring_func;
    j["n_group"] = n_group;
    j["topk_group"] = topk_group;
    j["routed_scaling_factor"] = routed_scaling_factor;
    j["n_shared_experts"] = n_shared_experts;
    if (score_correction_bias) j["topk_method"] = "noaux_tc";
    if (router_aux_loss_coef > 0) {
      j["output_router_logits"] = true;
      j["router_aux_loss_coef"] = router_aux_loss_coef;
    }
  }
  if (rope_scaling) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rope_scaling->factor},
                         {"low_freq_factor", rope_scaling->low_freq_factor},
                         {"high_freq_factor", rope_scaling->high_freq_factor},
                         {"original_max_position_embeddings", rope_scaling->original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  return j.dump(2) + "\n";
}

void LlamaConfig::validate() const {
  QUILT_CHECK(hidden_size > 0 && intermediate_size > 0 && num_hidden_layers >= 0 && vocab_size > 0,
              "[llama config] sizes must be positive (hidden_size=", hidden_size, ", intermediate_size=",
              intermediate_size, ", num_hidden_layers=", num_hidden_layers, ", vocab_size=", vocab_size, ")");
  QUILT_CHECK(num_attention_heads > 0 && num_key_value_heads > 0 && num_attention_heads % num_key_value_heads == 0,
              "[llama config] num_attention_heads=", num_attention_heads,
              " must be a positive multiple of num_key_value_heads=", num_key_value_heads);
  QUILT_CHECK(head_dim > 0 && head_dim % 2 == 0, "[llama config] head_dim=", head_dim, " must be positive and even");
  if (num_experts > 0) {
    QUILT_CHECK(decoder_sparse_step >= 1, "[llama config] decoder_sparse_step must be >= 1, got ", decoder_sparse_step);
    QUILT_CHECK(scoring_func == "softmax" || scoring_func == "sigmoid", "[llama config] scoring_func '", scoring_func,
                "' is not one of softmax, sigmoid");
    for (int64_t l : mlp_only_layers)
      QUILT_CHECK(l >= 0 && l < num_hidden_layers, "[llama config] mlp_only_layers names layer ", l, ", not one of the ",
                  num_hidden_layers, " layers");
    moe_options().validate();
  }
}

bool LlamaConfig::is_sparse_layer(int64_t layer) const {
  if (num_experts <= 0 || layer < first_k_dense_replace || (layer + 1) % decoder_sparse_step != 0) return false;
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end();
}

double LlamaConfig::layer_macs_per_token(int64_t layer, int64_t seq_len) const {
  const double h = double(hidden_size), q = double(num_attention_heads * head_dim),
               kv = double(num_key_value_heads * head_dim);
  const double attention = h * (q + 2 * kv) + q * h + 2 * q * double(seq_len) / 2;  // causal: half the scores
  double mlp = 3 * h * double(intermediate_size);
  if (is_sparse_layer(layer))
    mlp = h * double(num_experts) +
          3 * h * double(moe_intermediate_size) * double(num_experts_per_tok + n_shared_experts);
  return attention + mlp;
}

MoeOptions LlamaConfig::moe_options() const {
  MoeOptions o;
  o.hidden_size = hidden_size;
  o.num_experts = num_experts;
  o.top_k = num_experts_per_tok;
  o.intermediate_size = moe_intermediate_size;
  o.norm_topk_prob = norm_topk_prob;
  o.scoring = scoring_func == "sigmoid" ? MoeScoring::sigmoid : MoeScoring::softmax;
  o.n_group = n_group;
  o.topk_group = topk_group;
  o.routed_scaling_factor = routed_scaling_factor;
  o.n_shared_experts = n_shared_experts;
  o.score_correction_bias = score_correction_bias;
  o.load_balance_coeff = load_balance_coeff;
  o.router_aux_loss_coef = router_aux_loss_coef;
  o.init_std = initializer_range;
  return o;
}

std::pair<Tensor, Tensor> rope_tables(const LlamaConfig& cfg, int64_t max_positions) {
  const int64_t half = cfg.head_dim / 2;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(cfg.rope_theta, double(2 * i) / double(cfg.head_dim));
    if (cfg.rope_scaling) {  // llama3: slow down low frequencies, keep high ones, blend between
      const RopeScaling& s = *cfg.rope_scaling;
      const double low_wavelen = double(s.original_max_position_embeddings) / s.low_freq_factor;
      const double high_wavelen = double(s.original_max_position_embeddings) / s.high_freq_factor;
      const double wavelen = 2 * M_PI / f;
      if (wavelen > low_wavelen) {
        f = f / s.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (double(s.original_max_position_embeddings) / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
    inv[size_t(i)] = f;
  }
  std::vector<double> c(static_cast<size_t>(max_positions * half)), sn(c.size());
  for (int64_t p = 0; p < max_positions; ++p)
    for (int64_t i = 0; i < half; ++i) {
      c[size_t(p * half + i)] = std::cos(double(p) * inv[size_t(i)]);
      sn[size_t(p * half + i)] = std::sin(double(p) * inv[size_t(i)]);
    }
  // Kept in f64 (a few KiB): each forward rounds them once to its own dtype.
  return {from_vector(c, {max_positions, half}, {.dtype = DType::f64}),
          from_vector(sn, {max_positions, half}, {.dtype = DType::f64})};
}

LlamaAttention::LlamaAttention(const LlamaConfig& cfg)
    : Module("LlamaAttention"), heads_(cfg.num_attention_heads), kv_heads_(cfg.num_key_value_heads),
      head_dim_(cfg.head_dim) {
  q_proj = register_module("q_proj", std::make_shared<Linear>(cfg.hidden_size, heads_ * head_dim_, false));
  k_proj = register_module("k_proj", std::make_shared<Linear>(cfg.hidden_size, kv_heads_ * head_dim_, false));
  v_proj = register_module("v_proj", std::make_shared<Linear>(cfg.hidden_size, kv_heads_ * head_dim_, false));
  o_proj = register_module("o_proj", std::make_shared<Linear>(heads_ * head_dim_, cfg.hidden_size, false));
  for (auto* l : {q_proj.get(), k_proj.get(), v_proj.get(), o_proj.get()}) l->init_std = cfg.initializer_range;
  if (cfg.qk_norm) {
    q_norm = register_module("q_norm", std::make_shared<RMSNorm>(head_dim_, cfg.rms_norm_eps));
    k_norm = register_module("k_norm", std::make_shared<RMSNorm>(head_dim_, cfg.rms_norm_eps));
  }
}

Tensor local_causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& /*positions*/,
                              const Tensor& document_ids) {
  // The tokens of a row are in order (positions restart per document in packed rows, where
  // the document mask keeps attention inside each document), so causal by index suffices.
  return scaled_dot_product_attention(q, k, v, {.causal = true, .document_ids = document_ids}).out;
}

Tensor LlamaAttention::operator()(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                                  const Tensor& document_ids) {
  return call_with_hooks({x, cos, sin, positions, document_ids}, [this](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{forward_rope(in[0], in[1], in[2], in[3], in[4])};
  })[0];
}

Tensor LlamaAttention::forward_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                                    const Tensor& document_ids) {
  const int64_t b = x.size(0), t = x.size(1);
  // (B, T, H*D) -> (B, H, T, D); under tensor parallelism H is this rank's heads.
  Tensor q = (*q_proj)(x).view({b, t, -1, head_dim_});
  Tensor k = (*k_proj)(x).view({b, t, -1, head_dim_});
  if (q_norm) {
    // Qwen3: each head's query and key normalised over head_dim before RoPE. Under tensor
    // parallelism the heads here are this rank's, so the norms' weights are used locally.
    q = rms_norm(q, local_view(q_norm->weight()), q_norm->eps);
    k = rms_norm(k, local_view(k_norm->weight()), k_norm->eps);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  Tensor v = (*v_proj)(x).view({b, t, -1, head_dim_}).transpose(1, 2);
  q = rotary_embedding(q, cos, sin);
  k = rotary_embedding(k, cos, sin);
  Tensor y = attention(q, k, v, positions, document_ids);
  return (*o_proj)(y.transpose(1, 2).reshape({b, t, -1}));
}

LlamaMLP::LlamaMLP(const LlamaConfig& cfg) : Module("LlamaMLP") {
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(cfg.hidden_size, cfg.intermediate_size, false));
  up_proj = register_module("up_proj", std::make_shared<Linear>(cfg.hidden_size, cfg.intermediate_size, false));
  down_proj = register_module("down_proj", std::make_shared<Linear>(cfg.intermediate_size, cfg.hidden_size, false));
  for (auto* l : {gate_proj.get(), up_proj.get(), down_proj.get()}) l->init_std = cfg.initializer_range;
}

Tensor LlamaMLP::forward(const Tensor& x) { return (*down_proj)(swiglu((*gate_proj)(x), (*up_proj)(x))); }

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaConfig& cfg, int64_t layer) : Module("LlamaDecoderLayer") {
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(cfg));
  if (cfg.is_sparse_layer(layer)) mlp = register_module("mlp", std::make_shared<MoE>(cfg.moe_options()));
  else mlp = register_module("mlp", std::make_shared<LlamaMLP>(cfg));
  input_layernorm = register_module("input_layernorm", std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps));
}

Tensor LlamaDecoderLayer::operator()(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                                     const Tensor& document_ids) {
  return call_with_hooks({x, cos, sin, positions, document_ids}, [this](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{forward_block(in[0], in[1], in[2], in[3], in[4])};
  })[0];
}

Tensor LlamaDecoderLayer::forward_block(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                                        const Tensor& document_ids) {
  Tensor h = x + (*self_attn)((*input_layernorm)(x), cos, sin, positions, document_ids);
  return h + (*mlp)((*post_attention_layernorm)(h));
}

namespace {

// The stage with end_layer resolved; throws naming the field that is out of range.
LlamaStage resolve(const LlamaConfig& cfg, LlamaStage st) {
  const int64_t n = cfg.num_hidden_layers;
  if (st.end_layer < 0) st.end_layer = n;
  QUILT_CHECK(st.first_layer >= 0 && st.first_layer <= st.end_layer && st.end_layer <= n, "[llama stage] layers [",
              st.first_layer, ", ", st.end_layer, ") are not a range of the ", n, " layers (first_layer, end_layer)");
  QUILT_CHECK(!cfg.tie_word_embeddings || st.embed == st.head, "[llama stage] tie_word_embeddings shares the "
              "embedding with the head, so a stage holds both or neither (embed=", st.embed, ", head=", st.head, ")");
  return st;
}

}  // namespace

LlamaModel::LlamaModel(const LlamaConfig& cfg, const LlamaStage& stage) : Module("LlamaModel"), cfg_(cfg) {
  cfg.validate();
  const LlamaStage st = resolve(cfg, stage);
  if (st.embed) {
    embed_tokens = register_module("embed_tokens", std::make_shared<Embedding>(cfg.vocab_size, cfg.hidden_size));
    embed_tokens->init_std = cfg.initializer_range;
  }
  layers = register_module("layers", std::make_shared<ModuleDict>());
  for (int64_t i = st.first_layer; i < st.end_layer; ++i)
    layers->insert(std::to_string(i), std::make_shared<LlamaDecoderLayer>(cfg, i));
  if (st.head) norm = register_module("norm", std::make_shared<RMSNorm>(cfg.hidden_size, cfg.rms_norm_eps));
  auto [c, s] = rope_tables(cfg, cfg.max_position_embeddings);
  register_buffer("rope_cos", c, /*persistent=*/false);
  register_buffer("rope_sin", s, /*persistent=*/false);
}

std::vector<int64_t> LlamaModel::layer_indices() const {
  std::vector<int64_t> out;
  for (const auto& k : layers->keys()) out.push_back(std::stoll(k));
  return out;
}

std::pair<Tensor, Tensor> LlamaModel::rope(const Tensor& positions) {
  QUILT_CHECK(positions.defined() && (positions.dim() == 1 || positions.dim() == 2) &&
                  (positions.dtype() == DType::i64 || positions.dtype() == DType::i32),
              "[LlamaModel] positions must be (T) or (B, T) integers, got ",
              positions.defined() ? detail::concat(positions.shape(), " ", dtype_name(positions.dtype())) : "none");
  // Rows of the precomputed tables picked by position: a position past the table is refused
  // by the lookup, naming it.
  Tensor c = embedding(buffer("rope_cos"), positions), s = embedding(buffer("rope_sin"), positions);
  if (positions.dim() == 2) {  // (B, T, D/2) -> (B, 1, T, D/2): one table per sequence, shared by its heads
    c = unsqueeze(c, 1);
    s = unsqueeze(s, 1);
  }
  return {c, s};
}

Tensor LlamaModel::operator()(const Tensor& x, const Tensor& positions, const Tensor& document_ids) {
  return call_with_hooks({x, positions, document_ids}, [this](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{forward(in[0], in[1], in[2])};
  })[0];
}

Tensor LlamaModel::forward(const Tensor& x, const Tensor& positions, const Tensor& document_ids) {
  Tensor h = x;
  if (embed_tokens) {
    QUILT_CHECK(x.dim() == 2 && !is_floating(x.dtype()), "[LlamaModel] tokens must be (batch, seq) integers, got shape ",
                x.shape(), " ", dtype_name(x.dtype()));
    h = (*embed_tokens)(x);
  } else {
    QUILT_CHECK(x.dim() == 3 && is_floating(x.dtype()), "[LlamaModel] this stage holds no embedding: it takes hidden "
                "states (batch, seq, ", cfg_.hidden_size, "), got shape ", x.shape(), " ", dtype_name(x.dtype()));
  }
  auto [c, s] = rope(positions);
  for (const auto& [key, m] : *layers)
    h = static_cast<LlamaDecoderLayer&>(*m)(h, c, s, positions, document_ids);
  return norm ? (*norm)(h) : h;
}

Tensor LlamaModel::forward(const Tensor& x) {
  QUILT_CHECK(x.dim() >= 2, "[LlamaModel] input must be (batch, seq, ...), got shape ", x.shape());
  const int64_t t = x.size(1);
  QUILT_CHECK(t <= cfg_.max_position_embeddings, "[LlamaModel] sequence length ", t,
              " exceeds max_position_embeddings=", cfg_.max_position_embeddings);
  return forward(x, arange(0, double(t), 1, {.dtype = DType::i64, .device = x.device()}));
}

LlamaForCausalLM::LlamaForCausalLM(const LlamaConfig& cfg, const LlamaStage& stage)
    : Module("LlamaForCausalLM"), cfg_(cfg), stage_(resolve(cfg, stage)) {
  model = register_module("model", std::make_shared<LlamaModel>(cfg, stage_));
  if (stage_.head && !cfg.tie_word_embeddings) {
    lm_head = register_module("lm_head", std::make_shared<Linear>(cfg.hidden_size, cfg.vocab_size, false));
    lm_head->init_std = cfg.initializer_range;
  }
}

Tensor LlamaForCausalLM::operator()(const Tensor& x, const Tensor& positions, const Tensor& document_ids) {
  return call_with_hooks({x, positions, document_ids}, [this](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{forward(in[0], in[1], in[2])};
  })[0];
}

Tensor LlamaForCausalLM::forward(const Tensor& x, const Tensor& positions, const Tensor& document_ids) {
  Tensor h = (*model)(x, positions, document_ids);
  if (!has_head()) return h;
  return lm_head ? (*lm_head)(h) : linear(h, model->embed_tokens->weight());
}

Tensor LlamaForCausalLM::forward(const Tensor& x) {
  QUILT_CHECK(x.dim() >= 2, "[LlamaForCausalLM] input must be (batch, seq, ...), got shape ", x.shape());
  QUILT_CHECK(x.size(1) <= cfg_.max_position_embeddings, "[LlamaForCausalLM] sequence length ", x.size(1),
              " exceeds max_position_embeddings=", cfg_.max_position_embeddings);
  return forward(x, arange(0, double(x.size(1)), 1, {.dtype = DType::i64, .device = x.device()}));
}

namespace {

// The tensor names a HF checkpoint (one file, or an index with its weight_map) holds.
std::set<std::string> hf_names(const std::string& path) {
  std::set<std::string> names;
  if (path.size() >= 5 && path.substr(path.size() - 5) == ".json") {
    std::ifstream in(path);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
      for (const auto& [name, file] : j.at("weight_map").items()) names.insert(name);
    } catch (const std::exception& e) {
      fail("[load_hf_weights] ", path, " is not a valid safetensors index: ", e.what());
    }
  } else {
    for (const SafetensorsEntry& e : read_safetensors_index(path).entries) names.insert(e.name);
  }
  return names;
}

}  // namespace

void load_hf_weights(Module& model, const std::string& path) {
  // A router's correction bias is state of aux-loss-free training: checkpoints of models
  // trained without it (Qwen3-MoE) lack it, and it then starts at zero.
  const std::set<std::string> in_file = hf_names(path);
  dtensor::StateDict targets;
  for (auto& [name, t] : model.state_dict()) {
    const bool bias = name.size() > 23 && name.compare(name.size() - 23, 23, "e_score_correction_bias") == 0;
    if (bias && !in_file.count(name)) continue;
    targets.emplace_back(name, t);
  }
  std::vector<dtensor::StackedName> stacks;
  for (const ExpertStack& s : expert_stacks(model)) stacks.push_back({s.name, s.pattern, s.count});
  NoGradGuard ng;
  dtensor::import_consolidated(path, targets, stacks);
}

double LlamaForCausalLM::flops_per_token(int64_t seq_len) const {
  double n = 0;
  for (const Tensor& p : parameters()) n += double(p.numel());
  // A token passes through k of a block's routed experts, not all of them.
  for (auto& [name, moe] : moe_blocks(const_cast<LlamaForCausalLM&>(*this))) {
    const MoeOptions& o = moe->options();
    n -= double(3 * o.hidden_size * o.intermediate_size * (o.num_experts - o.top_k));
  }
  if (has_embedding() && !cfg_.tie_word_embeddings)
    n -= double(cfg_.vocab_size * cfg_.hidden_size);  // the embedding lookup is free
  const double attn = 12.0 * double(model->layers->size()) * double(cfg_.num_attention_heads * cfg_.head_dim) *
                      double(seq_len) / 2;  // causal: half the score matrix
  return 6.0 * n + attn;
}

}  // namespace quilt
