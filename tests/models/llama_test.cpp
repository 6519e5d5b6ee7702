// The Llama decoder: HF names and config, shapes, weight interchange, and that it learns.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <unistd.h>
#include <set>

#include "engine/engine.h"
#include "models/llama/llama.h"

using namespace quilt;

namespace {
LlamaConfig tiny(bool tie = false) {
  LlamaConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 50;
  c.max_position_embeddings = 64;
  c.tie_word_embeddings = tie;
  return c;
}
}  // namespace

TEST_CASE("llama: parameters carry HF names and shapes") {
  LlamaForCausalLM m(tiny());
  std::set<std::string> names;
  for (auto& [n, p] : m.named_parameters()) names.insert(n);
  for (const char* n : {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                        "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight",
                        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                        "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight",
                        "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                        "model.norm.weight", "lm_head.weight"})
    CHECK_MESSAGE(names.count(n) == 1, n);
  CHECK(names.size() == 2 * 9 + 3);
  CHECK(m.parameter("model.layers.0.self_attn.k_proj.weight").shape() == Shape{16, 32});  // 2 kv heads x 8
  LlamaForCausalLM tied(tiny(true));
  CHECK_FALSE(tied.has_parameter("lm_head.weight"));
}

TEST_CASE("llama: config.json round-trips, with llama3 rope scaling, and bad shapes are named") {
  LlamaConfig c = tiny();
  c.rope_scaling = RopeScaling{8.0, 1.0, 4.0, 32};
  LlamaConfig d = LlamaConfig::from_json(c.to_json());
  CHECK(d.to_json() == c.to_json());
  CHECK(d.rope_scaling->factor == 8.0);
  CHECK_THROWS_WITH_AS(LlamaConfig::from_json(R"({"num_attention_heads": 4, "num_key_value_heads": 3})"),
                       doctest::Contains("num_attention_heads=4 must be a positive multiple of num_key_value_heads=3"), Error);
  CHECK_THROWS_WITH_AS(LlamaConfig::from_json("{"), doctest::Contains("[llama config] config.json is not valid JSON"), Error);
  // llama3 scaling slows the low frequencies only.
  auto [c0, s0] = rope_tables(tiny(), 40);
  auto [c1, s1] = rope_tables(c, 40);
  CHECK(c0.select(0, 39).to_vector()[0] == c1.select(0, 39).to_vector()[0]);   // highest frequency kept
  CHECK(c0.select(0, 39).to_vector()[3] != c1.select(0, 39).to_vector()[3]);   // lowest one scaled
}

TEST_CASE("llama: logits are causal and of shape (B, T, V)") {
  LlamaForCausalLM m(tiny());
  m.init_weights(3);
  Tensor tok = randint(0, 50, {2, 7}, RngKey(1, "tok"));
  Tensor logits = m.forward(tok);
  CHECK(logits.shape() == Shape{2, 7, 50});
  // Changing the last token leaves the logits of earlier positions unchanged.
  std::vector<double> t2 = tok.to_vector();
  t2[6] = double((int64_t(t2[6]) + 1) % 50);
  Tensor logits2 = m.forward(from_vector(t2, {2, 7}, {.dtype = DType::i64}));
  CHECK(logits.narrow(1, 0, 6).to_vector() == logits2.narrow(1, 0, 6).to_vector());
  CHECK(logits.narrow(1, 6, 1).to_vector() != logits2.narrow(1, 6, 1).to_vector());
}

TEST_CASE("llama: HF-named weights saved from one model load into another") {
  const auto path = std::filesystem::temp_directory_path() / ("quilt_llama_" + std::to_string(::getpid()) + ".safetensors");
  LlamaForCausalLM a(tiny()), b(tiny());
  a.init_weights(1);
  b.init_weights(2);
  std::vector<std::pair<std::string, Tensor>> w;
  for (auto& [n, t] : a.state_dict()) w.emplace_back(n, t);
  save_safetensors(path.string(), w, {{"format", "pt"}});
  Tensor tok = randint(0, 50, {1, 5}, RngKey(2, "tok"));
  CHECK(a.forward(tok).to_vector() != b.forward(tok).to_vector());
  load_hf_weights(b, path.string());
  CHECK(a.forward(tok).to_vector() == b.forward(tok).to_vector());
  std::filesystem::remove(path);
}

TEST_CASE("llama: a few AdamW steps on a repeated batch drive the loss down") {
  LlamaForCausalLM m(tiny());
  m.init_weights(4);
  AdamW opt(m.parameters(), AdamWOptions{.lr = 1e-2, .weight_decay = 0.0});
  Tensor x = randint(0, 50, {2, 16}, RngKey(5, "x")), y = randint(0, 50, {2, 16}, RngKey(5, "y"));
  double first = 0, last = 0;
  for (int s = 0; s < 30; ++s) {
    Tensor loss = m.loss(x, y);
    loss.backward();
    opt.step();
    opt.zero_grad();
    last = loss.item<double>();
    if (s == 0) first = last;
  }
  CHECK(first == doctest::Approx(std::log(50.0)).epsilon(0.05));  // near-uniform start
  CHECK(last < first * 0.5);
}
