// The Llama decoder: HF names and config, shapes, weight interchange, and that it learns.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <unistd.h>
#include <set>

#include "engine/engine.h"
#include "models/llama/llama.h"
#include "tests/parallel/tiny_llama.h"

using namespace quilt;


TEST_CASE("llama: parameters carry HF names and shapes") {
  LlamaForCausalLM m(test::tiny_llama());
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
  LlamaForCausalLM tied(test::tiny_llama(true));
  CHECK_FALSE(tied.has_parameter("lm_head.weight"));
}

TEST_CASE("llama: config.json round-trips, with llama3 rope scaling, and bad shapes are named") {
  LlamaConfig c = test::tiny_llama();
  c.rope_scaling = RopeScaling{8.0, 1.0, 4.0, 32};
  LlamaConfig d = LlamaConfig::from_json(c.to_json());
  CHECK(d.to_json() == c.to_json());
  CHECK(d.rope_scaling->factor == 8.0);
  CHECK_THROWS_WITH_AS(LlamaConfig::from_json(R"({"num_attention_heads": 4, "num_key_value_heads": 3})"),
                       doctest::Contains("num_attention_heads=4 must be a positive multiple of num_key_value_heads=3"), Error);
  CHECK_THROWS_WITH_AS(LlamaConfig::from_json("{"), doctest::Contains("[llama config] config.json is not valid JSON"), Error);
  // llama3 scaling slows the low frequencies only.
  auto [c0, s0] = rope_tables(test::tiny_llama(), 40);
  auto [c1, s1] = rope_tables(c, 40);
  CHECK(c0.select(0, 39).to_vector()[0] == c1.select(0, 39).to_vector()[0]);   // highest frequency kept
  CHECK(c0.select(0, 39).to_vector()[3] != c1.select(0, 39).to_vector()[3]);   // lowest one scaled
}

TEST_CASE("llama: logits are causal and of shape (B, T, V)") {
  LlamaForCausalLM m(test::tiny_llama());
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
  LlamaForCausalLM a(test::tiny_llama()), b(test::tiny_llama());
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
  LlamaForCausalLM m(test::tiny_llama());
  m.init_weights(4);
  AdamW opt(m.parameters(), AdamWOptions{.lr = 1e-2, .weight_decay = 0.0});
  Tensor x = randint(0, 50, {2, 16}, RngKey(5, "x")), y = randint(0, 50, {2, 16}, RngKey(5, "y"));
  const int64_t v = m.config().vocab_size;
  double first = 0, last = 0;
  for (int s = 0; s < 30; ++s) {
    Tensor loss = cross_entropy(m(x, arange(0, 16)).reshape({-1, v}), y.reshape({-1}));
    loss.backward();
    opt.step();
    opt.zero_grad();
    last = loss.item<double>();
    if (s == 0) first = last;
  }
  CHECK(first == doctest::Approx(std::log(50.0)).epsilon(0.05));  // near-uniform start
  CHECK(last < first * 0.5);
}

namespace {
LlamaConfig four_layers() {
  LlamaConfig c = test::tiny_llama();
  c.num_hidden_layers = 4;
  return c;
}
Tensor positions(int64_t t, int64_t start = 0) { return arange(double(start), double(start + t)); }
}  // namespace

TEST_CASE("llama: a stage holding layers 2..3 keeps their global names and holds no embedding") {
  LlamaForCausalLM m(four_layers(), {.first_layer = 2, .embed = false});
  std::set<std::string> names;
  for (auto& [n, p] : m.named_parameters()) names.insert(n);
  CHECK(names.count("model.layers.2.self_attn.q_proj.weight") == 1);
  CHECK(names.count("model.layers.3.mlp.down_proj.weight") == 1);
  CHECK(names.count("model.norm.weight") == 1);
  CHECK(names.count("lm_head.weight") == 1);
  CHECK(names.count("model.layers.0.self_attn.q_proj.weight") == 0);
  CHECK(names.count("model.embed_tokens.weight") == 0);
  CHECK(names.size() == 2 * 9 + 2);
  CHECK(m.model->layer_indices() == std::vector<int64_t>{2, 3});
  CHECK(m.model->layers->keys() == std::vector<std::string>{"2", "3"});
  CHECK(m.stage().end_layer == 4);
  CHECK_FALSE(m.has_embedding());
  CHECK(m.has_head());
  LlamaForCausalLM first(four_layers(), {.end_layer = 2, .head = false});
  CHECK_FALSE(first.has_head());
  CHECK(first.lm_head == nullptr);
  CHECK_FALSE(first.has_parameter("model.norm.weight"));
}

TEST_CASE("llama: stage 0 (embedding + layers 0..1) into stage 1 (layers 2..3 + norm + head) gives the full model's logits") {
  LlamaForCausalLM full(four_layers());
  LlamaForCausalLM s0(four_layers(), {.end_layer = 2, .head = false});
  LlamaForCausalLM s1(four_layers(), {.first_layer = 2, .embed = false});
  for (Module* m : {(Module*)&full, (Module*)&s0, (Module*)&s1}) m->init_weights(7);  // keyed by global name
  Tensor tok = randint(0, 50, {2, 9}, RngKey(3, "tok"));
  Tensor pos = positions(9);
  Tensor hidden = s0(tok, pos);
  CHECK(hidden.shape() == Shape{2, 9, 32});
  Tensor logits = s1(hidden, pos);
  CHECK(logits.shape() == Shape{2, 9, 50});
  CHECK(logits.to_vector() == full(tok, pos).to_vector());
  CHECK_THROWS_WITH_AS(s1(tok, pos), doctest::Contains("this stage holds no embedding"), Error);
}

TEST_CASE("llama: explicit positions 0..T-1, as (T) or (B, T), give the implicit positions' logits") {
  LlamaForCausalLM m(test::tiny_llama());
  m.init_weights(5);
  Tensor tok = randint(0, 50, {2, 7}, RngKey(4, "tok"));
  const std::vector<double> implicit = m.forward(tok).to_vector();
  CHECK(m(tok, positions(7)).to_vector() == implicit);
  Tensor per_row = from_vector({0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6}, {2, 7}, {.dtype = DType::i64});
  CHECK(m(tok, per_row).to_vector() == implicit);
}

TEST_CASE("llama: shifted positions rotate q and k by the shift, so logits (relative positions) stay and a reorder changes them") {
  LlamaConfig cfg = test::tiny_llama();
  LlamaForCausalLM m(cfg);
  m.init_weights(6);
  // The tables at positions p are the rows p of the precomputed tables.
  auto [c, s] = m.model->rope(positions(5, 3));
  auto [tc, ts] = rope_tables(cfg, cfg.max_position_embeddings);
  CHECK(c.to_vector() == tc.narrow(0, 3, 5).to_vector());
  CHECK(s.to_vector() == ts.narrow(0, 3, 5).to_vector());
  // Attention sees only q·k of rotations by p_q and p_k, which depends on p_q - p_k.
  Tensor tok = randint(0, 50, {1, 6}, RngKey(8, "tok"));
  const std::vector<double> base = m(tok, positions(6)).to_vector();
  const std::vector<double> shifted = m(tok, positions(6, 11)).to_vector();
  // (other rotations, so other rounding, usually; with some GEMM libraries bit-identical: the
  // tables above show the rotations differ)
  double worst = 0;
  for (size_t i = 0; i < base.size(); ++i) worst = std::max(worst, std::fabs(base[i] - shifted[i]));
  CHECK(worst < 1e-4);
  // Different gaps between positions change the logits after the first token.
  Tensor gaps = from_vector({0, 2, 4, 6, 8, 10}, {6}, {.dtype = DType::i64});
  std::vector<double> spread = m(tok, gaps).to_vector();
  double moved = 0;
  for (size_t i = 0; i < base.size(); ++i) moved = std::max(moved, std::fabs(base[i] - spread[i]));
  CHECK(moved > 1e-3);
  // Per-sequence positions (B, T): each row gets its own rotation (equal to running the rows
  // alone up to the rounding a batch of 2 vs 1 changes in the products).
  Tensor two = randint(0, 50, {2, 6}, RngKey(9, "tok"));
  Tensor rows = from_vector({0, 1, 2, 3, 4, 5, 0, 2, 4, 6, 8, 10}, {2, 6}, {.dtype = DType::i64});
  Tensor both = m(two, rows);
  auto diff = [](const Tensor& a, const Tensor& b) {
    double d = 0;
    const auto va = a.to_vector(), vb = b.to_vector();
    for (size_t i = 0; i < va.size(); ++i) d = std::max(d, std::fabs(va[i] - vb[i]));
    return d;
  };
  CHECK(diff(both.narrow(0, 0, 1), m(two.narrow(0, 0, 1), positions(6))) < 1e-6);
  CHECK(diff(both.narrow(0, 1, 1), m(two.narrow(0, 1, 1), gaps)) < 1e-6);
  CHECK(diff(both.narrow(0, 1, 1), m(two.narrow(0, 1, 1), positions(6))) > 1e-4);
}

TEST_CASE("llama: HF-named weights of the whole model load into a stage, which then computes the full model's part") {
  const auto path = std::filesystem::temp_directory_path() / ("quilt_llama_stage_" + std::to_string(::getpid()) + ".safetensors");
  LlamaForCausalLM full(four_layers());
  full.init_weights(1);
  std::vector<std::pair<std::string, Tensor>> w;
  for (auto& [n, t] : full.state_dict()) w.emplace_back(n, t);
  save_safetensors(path.string(), w, {{"format", "pt"}});
  LlamaForCausalLM s0(four_layers(), {.end_layer = 2, .head = false});
  LlamaForCausalLM s1(four_layers(), {.first_layer = 2, .embed = false});
  s0.init_weights(2);
  s1.init_weights(2);
  load_hf_weights(s0, path.string());
  load_hf_weights(s1, path.string());
  Tensor tok = randint(0, 50, {1, 5}, RngKey(2, "tok"));
  CHECK(s1(s0(tok, positions(5)), positions(5)).to_vector() == full(tok, positions(5)).to_vector());
  std::filesystem::remove(path);
}

TEST_CASE("llama: a stage out of range, or splitting tied embeddings from the head, is refused naming it") {
  CHECK_THROWS_WITH_AS(LlamaForCausalLM(four_layers(), {.first_layer = 3, .end_layer = 5}),
                       doctest::Contains("layers [3, 5) are not a range of the 4 layers"), Error);
  LlamaConfig tied = four_layers();
  tied.tie_word_embeddings = true;
  CHECK_THROWS_WITH_AS(LlamaForCausalLM(tied, {.first_layer = 2, .embed = false}),
                       doctest::Contains("tie_word_embeddings"), Error);
  CHECK_NOTHROW(LlamaForCausalLM(tied, {.first_layer = 1, .end_layer = 3, .embed = false, .head = false}));
}
