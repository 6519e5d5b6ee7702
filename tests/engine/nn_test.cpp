// nn modules: dotted names, lookup and replacement, state dicts, name-keyed init, modes,
// hooks, conversion, and the standard layers against direct op calls.
#include <doctest/doctest.h>

#include <cmath>

#include "engine/engine.h"

using namespace quilt;

namespace {

// A miniature decoder: the names follow the HF Llama layout.
class Block : public Module {
 public:
  Block(int64_t d, bool reversed) : Module("Block") {
    // Registration order decides names' order, never their values.
    if (reversed) {
      mlp = register_module("mlp", std::make_shared<Linear>(d, d));
      norm = register_module("input_layernorm", std::make_shared<RMSNorm>(d));
    } else {
      norm = register_module("input_layernorm", std::make_shared<RMSNorm>(d));
      mlp = register_module("mlp", std::make_shared<Linear>(d, d));
    }
  }
  Tensor forward(const Tensor& x) override { return x + (*mlp)((*norm)(x)); }
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<Linear> mlp;
};

class Tiny : public Module {
 public:
  explicit Tiny(int64_t vocab = 11, int64_t d = 8, int64_t n_layers = 2, bool reversed = false) : Module("Tiny") {
    embed = register_module("embed_tokens", std::make_shared<Embedding>(vocab, d));
    layers = register_module("layers", std::make_shared<ModuleList>());
    for (int64_t i = 0; i < n_layers; ++i) layers->push_back(std::make_shared<Block>(d, reversed));
    lm_head = register_module("lm_head", std::make_shared<Linear>(d, vocab, false));
    register_buffer("step_table", arange(0, 4, 1, {.dtype = DType::f32}));
    register_buffer("scratch", zeros({2}), /*persistent=*/false);
  }
  Tensor forward(const Tensor& tokens) override {
    Tensor h = (*embed)(tokens);
    for (const auto& l : *layers) h = (*l)(h);
    return (*lm_head)(h);
  }
  std::shared_ptr<Embedding> embed;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<Linear> lm_head;
};

std::vector<std::string> names_of(const NamedTensors& v) {
  std::vector<std::string> out;
  for (const auto& [n, t] : v) out.push_back(n);
  return out;
}

bool same_values(const Tensor& a, const Tensor& b) { return a.shape() == b.shape() && a.to_vector() == b.to_vector(); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("nn: named_parameters gives HF-style dotted names in registration order") {
  Tiny m;
  const std::vector<std::string> expected = {
      "embed_tokens.weight", "layers.0.input_layernorm.weight", "layers.0.mlp.weight", "layers.0.mlp.bias",
      "layers.1.input_layernorm.weight", "layers.1.mlp.weight", "layers.1.mlp.bias", "lm_head.weight"};
  CHECK(names_of(m.named_parameters()) == expected);
  for (const auto& [name, t] : m.named_parameters()) {
    CHECK(t.name() == name);  // parameters carry their dotted name
    CHECK(t.requires_grad());
    CHECK(t.is_leaf());
  }
  CHECK(names_of(m.named_parameters("model")).front() == "model.embed_tokens.weight");

  CHECK(names_of(m.named_parameters("", /*recurse=*/false)).empty());
  CHECK(names_of(m.named_buffers()) == std::vector<std::string>{"step_table", "scratch"});
  CHECK(m.num_parameters() == 11 * 8 + 2 * (8 + 64 + 8) + 8 * 11);
  CHECK(m.parameters().size() == expected.size());

  std::vector<std::string> children;
  for (const auto& [n, c] : m.named_children()) children.push_back(n);
  CHECK(children == std::vector<std::string>{"embed_tokens", "layers", "lm_head"});
  std::vector<std::string> mods;
  for (const auto& [n, mod] : m.named_modules()) mods.push_back(n + ":" + mod->type_name());
  CHECK(mods == std::vector<std::string>{":Tiny", "embed_tokens:Embedding", "layers:ModuleList", "layers.0:Block",
                                         "layers.0.input_layernorm:RMSNorm", "layers.0.mlp:Linear", "layers.1:Block",
                                         "layers.1.input_layernorm:RMSNorm", "layers.1.mlp:Linear", "lm_head:Linear"});

  // A module appended to a list that already hangs in the model is named from the model's root.
  m.layers->push_back(std::make_shared<Linear>(2, 2));
  CHECK(m.parameter("layers.2.weight").name() == "layers.2.weight");
}

TEST_CASE("nn: dotted lookup finds parameters, buffers and submodules and names what is missing") {
  Tiny m;
  CHECK(m.parameter("layers.1.mlp.weight").is_same(m.layers->at<Block>(1).mlp->weight()));
  CHECK(&m.submodule("layers.1.mlp") == m.layers->at<Block>(1).mlp.get());
  CHECK(&m.submodule("") == &m);
  CHECK(m.buffer("step_table").to_vector() == std::vector<double>{0, 1, 2, 3});
  CHECK(m.has_parameter("lm_head.weight"));
  CHECK_FALSE(m.has_parameter("lm_head.bias.x"));
  CHECK_FALSE(m.has_parameter("nothing.here"));
  CHECK(m.has_buffer("scratch"));
  CHECK_THROWS_WITH_AS(m.parameter("layers.7.mlp.weight"), "[Tiny] no parameter 'layers.7.mlp.weight'", Error);
  CHECK_THROWS_WITH_AS(m.submodule("layers.3"), doctest::Contains("'layers' has no child '3' (children: 0, 1)"), Error);
  CHECK_THROWS_WITH_AS(m.layers->at<Linear>(0), doctest::Contains("element 0 is a Block"), Error);
  CHECK_THROWS_WITH_AS((*m.layers)[2], doctest::Contains("index 2 out of range for 2 modules"), Error);
  CHECK_THROWS_WITH_AS(m.register_buffer("layers", zeros({1})), doctest::Contains("'layers': the name is already taken"),
                       Error);
  CHECK_THROWS_WITH_AS(m.register_parameter("a.b", zeros({1})), doctest::Contains("contain no '.'"), Error);
}

TEST_CASE("nn: replace_parameter swaps the slot, forward uses the new tensor, tied weights appear once") {
  Tiny m;
  m.init_weights(3);
  Linear& mlp = *m.layers->at<Block>(0).mlp;
  Tensor x = randn({2, 8}, RngKey(1, "x"));
  Tensor replacement = zeros({8, 8}).set_requires_grad(true);
  m.replace_parameter("layers.0.mlp.weight", replacement);
  CHECK(mlp.weight().is_same(replacement));
  CHECK(replacement.name() == "layers.0.mlp.weight");
  // With a zero weight the layer returns its bias (zeros after init) for any input.
  CHECK(mlp(x).to_vector() == std::vector<double>(16, 0.0));

  // Tie the output projection to the embedding, as many LMs do.
  m.replace_parameter("lm_head.weight", m.embed->weight());
  CHECK(m.lm_head->weight().is_same(m.embed->weight()));
  auto names = names_of(m.named_parameters());
  CHECK(std::find(names.begin(), names.end(), "lm_head.weight") == names.end());
  CHECK(m.state_dict().contains("lm_head.weight"));  // both names in the state dict
  CHECK(m.state_dict().contains("embed_tokens.weight"));
}

TEST_CASE("nn: state_dict round-trips values in place and leaves non-persistent buffers out") {
  Tiny a, b;
  a.init_weights(1);
  b.init_weights(2);
  StateDict sd = a.state_dict();
  // Each module's own entries come before its children's, as in PyTorch.
  CHECK(sd.keys() == std::vector<std::string>{"step_table", "embed_tokens.weight", "layers.0.input_layernorm.weight",
                                              "layers.0.mlp.weight", "layers.0.mlp.bias",
                                              "layers.1.input_layernorm.weight", "layers.1.mlp.weight",
                                              "layers.1.mlp.bias", "lm_head.weight"});
  CHECK(sd.at("lm_head.weight").storage().id() == a.lm_head->weight().storage().id());  // no copy

  Tensor before = b.lm_head->weight();
  LoadResult r = b.load_state_dict(sd);
  CHECK(r.missing_keys.empty());
  CHECK(r.unexpected_keys.empty());
  CHECK(b.lm_head->weight().is_same(before));  // same tensor, values copied into it
  for (const auto& [name, t] : a.named_parameters()) CHECK(same_values(t, b.parameter(name)));
  Tensor tokens = from_vector({1, 5, 9, 0}, {2, 2}, {.dtype = DType::i64});
  CHECK(same_values(a(tokens), b(tokens)));
}

TEST_CASE("nn: load_state_dict names every missing, unexpected and mismatched key in one error") {
  Tiny m;
  m.init_weights(0);
  StateDict sd = m.state_dict();
  StateDict bad;
  for (const auto& [k, t] : sd)
    if (k != "lm_head.weight" && k != "step_table") bad.insert(k, t);
  bad.insert("extra.bias", zeros({3}));
  bad.insert("layers.0.mlp.weight", zeros({3, 8}));
  bad.insert("layers.1.mlp.bias", zeros({8}, {.dtype = DType::bf16}));
  Tensor kept = m.embed->weight().clone();
  bad.insert("embed_tokens.weight", zeros({11, 8}));

  const std::string msg = error_of([&] { m.load_state_dict(bad); });
  CHECK(msg ==
        "[load_state_dict] missing keys: step_table, lm_head.weight; unexpected keys: extra.bias; "
        "shape mismatch for layers.0.mlp.weight: checkpoint (3, 8) vs model (8, 8); "
        "dtype mismatch for layers.1.mlp.bias: checkpoint bf16 vs model f32");
  CHECK(same_values(m.embed->weight(), kept));  // nothing was copied

  // Non-strict: missing and unexpected keys are reported, mismatches still throw.
  StateDict partial;
  partial.insert("embed_tokens.weight", zeros({11, 8}));
  partial.insert("extra.bias", zeros({3}));
  LoadResult r = m.load_state_dict(partial, /*strict=*/false);
  CHECK(r.unexpected_keys == std::vector<std::string>{"extra.bias"});
  CHECK(r.missing_keys.size() == sd.size() - 1);
  CHECK(m.embed->weight().to_vector() == std::vector<double>(88, 0.0));
  partial.insert("lm_head.weight", zeros({2, 2}));
  CHECK_THROWS_WITH_AS(m.load_state_dict(partial, false),
                       "[load_state_dict] shape mismatch for lm_head.weight: checkpoint (2, 2) vs model (11, 8)", Error);
}

TEST_CASE("nn: init depends only on seed and name, not on construction order") {
  Tiny a(11, 8, 2, /*reversed=*/false), b(11, 8, 2, /*reversed=*/true);
  CHECK(names_of(a.named_parameters()) != names_of(b.named_parameters()));  // different order...
  a.init_weights(42);
  b.init_weights(42);
  for (const auto& [name, t] : a.named_parameters()) CHECK(same_values(t, b.parameter(name)));  // ...same values

  // The documented rules, checked against the RNG directly.
  CHECK(same_values(a.parameter("layers.1.mlp.weight"), randn({8, 8}, RngKey(42, "layers.1.mlp.weight"), {}, 0, 0.02)));
  CHECK(a.parameter("layers.1.mlp.bias").to_vector() == std::vector<double>(8, 0.0));
  CHECK(a.parameter("layers.0.input_layernorm.weight").to_vector() == std::vector<double>(8, 1.0));
  CHECK(same_values(a.parameter("embed_tokens.weight"), randn({11, 8}, RngKey(42, "embed_tokens.weight"), {}, 0, 0.02)));
  // Distinct names and seeds draw distinct values.
  CHECK_FALSE(same_values(a.parameter("layers.0.mlp.weight"), a.parameter("layers.1.mlp.weight")));
  Tiny c;
  c.init_weights(43);
  CHECK_FALSE(same_values(a.parameter("lm_head.weight"), c.parameter("lm_head.weight")));

  // A bf16 model starts from the rounded f32 values.
  Tiny h;
  h.to(DType::bf16);
  h.init_weights(42);
  CHECK(same_values(h.parameter("lm_head.weight"), a.parameter("lm_head.weight").to(DType::bf16)));

  // A custom module must say how its parameters start.
  struct Bare : Module {
    Bare() : Module("Bare") { register_parameter("w", Tensor::empty({2})); }
  } bare;
  CHECK_THROWS_WITH_AS(bare.init_weights(0), doctest::Contains("Bare does not say how to initialise its parameter 'w'"),
                       Error);
}

TEST_CASE("nn: train and eval propagate to every descendant, and dropout is the identity in eval") {
  Generator gen(5);
  auto seq = std::make_shared<Sequential>();
  seq->push_back(std::make_shared<Linear>(4, 4));
  auto drop = seq->push_back(std::make_shared<Dropout>(0.5, &gen));
  seq->init_weights(0);
  CHECK(seq->is_training());
  CHECK(drop->is_training());
  seq->eval();
  CHECK_FALSE(seq->is_training());
  CHECK_FALSE(drop->is_training());
  CHECK_FALSE(seq->submodule("0").is_training());
  Tensor x = randn({3, 4}, RngKey(0, "x"));
  CHECK(same_values((*drop)(x), x));
  CHECK(gen.counter() == 0);  // eval draws nothing
  seq->train();
  CHECK(drop->is_training());
  Tensor y = (*drop)(x);
  CHECK(gen.counter() == 1);
  int zeros_seen = 0;
  auto xv = x.to_vector(), yv = y.to_vector();
  for (size_t i = 0; i < xv.size(); ++i) {
    if (yv[i] == 0) ++zeros_seen;
    else CHECK(yv[i] == doctest::Approx(2 * xv[i]));
  }
  CHECK(zeros_seen > 0);
  CHECK(zeros_seen < 12);
  CHECK_THROWS_WITH_AS(Dropout(1.0), doctest::Contains("[Dropout] p must be in [0, 1), got 1"), Error);
}

TEST_CASE("nn: forward hooks run around forward, can replace inputs and outputs, and can be removed") {
  Linear lin(3, 2);
  lin.init_weights(0);
  std::vector<std::string> order;
  auto pre = lin.register_forward_pre_hook([&](Module& m, std::vector<Tensor>& in) {
    order.push_back("pre:" + m.type_name());
    in[0] = zeros_like(in[0]);  // the layer then sees zeros
  });
  auto post = lin.register_forward_hook([&](Module&, const std::vector<Tensor>& in, std::vector<Tensor>& out) {
    order.push_back("post");
    CHECK(in[0].to_vector() == std::vector<double>(6, 0.0));
    out[0] = out[0] + 1.0;
  });
  Tensor x = ones({2, 3});
  Tensor y = lin(x);
  CHECK(order == std::vector<std::string>{"pre:Linear", "post"});
  CHECK(y.to_vector() == std::vector<double>(4, 1.0));  // zero input, zero bias, +1
  CHECK(lin.remove_hook(pre));
  CHECK(lin.remove_hook(post));
  CHECK_FALSE(lin.remove_hook(post));
  CHECK(same_values(lin(x), linear(x, lin.weight(), lin.bias())));

  // A module with two inputs writes its call operator over call_with_hooks.
  struct Add2 : Module {
    Add2() : Module("Add2") {}
    using Module::operator();
    Tensor operator()(const Tensor& a, const Tensor& b) {
      return call_with_hooks({a, b}, [](const std::vector<Tensor>& in) { return std::vector<Tensor>{in[0] + in[1]}; })[0];
    }
  } add2;
  int calls = 0;
  auto h = add2.register_forward_pre_hook([&](Module&, std::vector<Tensor>& in) {
    ++calls;
    CHECK(in.size() == 2);
  });
  CHECK(add2(ones({2}), ones({2})).to_vector() == std::vector<double>{2, 2});
  CHECK(calls == 1);
  add2.remove_hook(h);
  CHECK_THROWS_WITH_AS(add2(ones({2})), doctest::Contains("[Add2] has no forward"), Error);
}

TEST_CASE("nn: to(dtype) converts parameters and floating buffers in their slots and keeps ties") {
  Tiny m;
  m.init_weights(9);
  m.replace_parameter("lm_head.weight", m.embed->weight());
  m.register_buffer("positions", arange(0, 3));
  Tensor f32_head = m.lm_head->weight().clone();
  m.to(DType::bf16);
  for (const auto& [name, t] : m.named_parameters()) {
    CHECK(t.dtype() == DType::bf16);
    CHECK(t.requires_grad());
    CHECK(t.name() == name);
  }
  CHECK(m.lm_head->weight().is_same(m.embed->weight()));  // still tied
  CHECK(m.buffer("step_table").dtype() == DType::bf16);
  CHECK(m.buffer("positions").dtype() == DType::i64);  // integers untouched
  CHECK(same_values(m.lm_head->weight(), f32_head.to(DType::bf16)));
  Tensor tokens = from_vector({1, 2}, {2}, {.dtype = DType::i64});
  CHECK(m(tokens).dtype() == DType::bf16);
  m.to(Device::cpu());  // already there: nothing changes
  CHECK(m.lm_head->weight().is_same(m.embed->weight()));
}

TEST_CASE("nn: Linear, Embedding and the norms compute what their ops compute") {
  TensorOptions f64{.dtype = DType::f64};
  Linear lin(5, 3, true, f64);
  lin.init_weights(1);
  Tensor x = randn({4, 5}, RngKey(2, "x"), f64);
  auto w = lin.weight().to_vector(), b = lin.bias().to_vector(), xv = x.to_vector();
  auto y = lin(x).to_vector();
  for (int i = 0; i < 4; ++i)
    for (int o = 0; o < 3; ++o) {
      double acc = b[size_t(o)];
      for (int k = 0; k < 5; ++k) acc += xv[size_t(i * 5 + k)] * w[size_t(o * 5 + k)];
      CHECK(y[size_t(i * 3 + o)] == doctest::Approx(acc).epsilon(1e-12));
    }
  Linear nobias(5, 3, false);
  CHECK_FALSE(nobias.bias().defined());
  CHECK(nobias.str() == "Linear(in_features=5, out_features=3, bias=false)");

  Embedding emb(6, 4, f64);
  emb.init_weights(1);
  Tensor idx = from_vector({5, 0, 5}, {3}, {.dtype = DType::i64});
  auto e = emb(idx).to_vector(), ew = emb.weight().to_vector();
  CHECK(emb(idx).shape() == Shape{3, 4});
  for (int j = 0; j < 4; ++j) {
    CHECK(e[size_t(j)] == ew[size_t(20 + j)]);
    CHECK(e[size_t(4 + j)] == ew[size_t(j)]);
  }

  RMSNorm rms(5, 1e-6, f64);
  rms.init_weights(0);
  auto r = rms(x).to_vector();
  for (int i = 0; i < 4; ++i) {
    double ms = 0;
    for (int k = 0; k < 5; ++k) ms += xv[size_t(i * 5 + k)] * xv[size_t(i * 5 + k)] / 5;
    for (int k = 0; k < 5; ++k)
      CHECK(r[size_t(i * 5 + k)] == doctest::Approx(xv[size_t(i * 5 + k)] / std::sqrt(ms + 1e-6)).epsilon(1e-10));
  }

  LayerNorm ln(5, 1e-5, true, f64);
  ln.init_weights(0);
  LayerNorm plain(5, 1e-5, false, f64);
  CHECK(plain.named_parameters().empty());
  auto l = ln(x).to_vector(), lp = plain(x).to_vector();
  for (int i = 0; i < 4; ++i) {
    double mean = 0, var = 0;
    for (int k = 0; k < 5; ++k) mean += xv[size_t(i * 5 + k)] / 5;
    for (int k = 0; k < 5; ++k) var += (xv[size_t(i * 5 + k)] - mean) * (xv[size_t(i * 5 + k)] - mean) / 5;
    for (int k = 0; k < 5; ++k) {
      const double want = (xv[size_t(i * 5 + k)] - mean) / std::sqrt(var + 1e-5);
      CHECK(l[size_t(i * 5 + k)] == doctest::Approx(want).epsilon(1e-10));
      CHECK(lp[size_t(i * 5 + k)] == doctest::Approx(want).epsilon(1e-10));
    }
  }
}

TEST_CASE("nn: gradients reach every parameter and zero_grad clears them") {
  Tiny m;
  m.init_weights(4);
  Tensor tokens = from_vector({1, 2, 3, 4, 5, 6}, {2, 3}, {.dtype = DType::i64});
  m(tokens).sum().backward();
  for (const auto& entry : m.named_parameters()) {  // no structured binding: clang 14 cannot capture one
    const auto& name = entry.first;
    const auto& t = entry.second;
    INFO(name);
    REQUIRE(t.grad().defined());
    CHECK(t.grad().shape() == t.shape());
  }
  m.zero_grad(/*set_to_none=*/false);
  for (const auto& [name, t] : m.named_parameters()) CHECK(t.grad().to_vector() == std::vector<double>(size_t(t.numel()), 0.0));
  m.zero_grad();
  for (const auto& [name, t] : m.named_parameters()) CHECK_FALSE(t.grad().defined());
}

TEST_CASE("nn: Sequential chains its modules and str() prints the tree") {
  auto seq = std::make_shared<Sequential>();
  seq->push_back(std::make_shared<Linear>(2, 3));
  seq->push_back(std::make_shared<LayerNorm>(3));
  seq->init_weights(0);
  Tensor x = randn({4, 2}, RngKey(0, "x"));
  Tensor want = seq->at<LayerNorm>(1)(seq->at<Linear>(0)(x));
  CHECK(same_values((*seq)(x), want));
  CHECK(seq->str() ==
        "Sequential(\n  (0): Linear(in_features=2, out_features=3, bias=true)\n  (1): LayerNorm(dim=3, eps=1e-05, "
        "affine=true)\n)");
  ModuleList list;
  CHECK_THROWS_WITH_AS(list(x), doctest::Contains("[ModuleList] has no forward"), Error);
}
