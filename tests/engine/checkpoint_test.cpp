// Activation checkpointing: identical gradients (dropout included), parameter gradients and
// hooks through the recomputation, lower peak memory, and the edge cases.
#include <doctest/doctest.h>

#include "engine/engine.h"

using namespace quilt;

namespace {

// Linear -> tanh -> dropout, three times (the last without dropout).
class Mlp : public Module {
 public:
  Mlp(Generator* gen, int64_t d_in = 16, int64_t d = 32, int64_t d_out = 4) : Module("Mlp") {
    l1 = register_module("l1", std::make_shared<Linear>(d_in, d));
    l2 = register_module("l2", std::make_shared<Linear>(d, d));
    l3 = register_module("l3", std::make_shared<Linear>(d, d_out));
    drop = register_module("drop", std::make_shared<Dropout>(0.3, gen));
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = (*drop)(tanh((*l1)(x)));
    h = (*drop)(tanh((*l2)(h)));
    return (*l3)(h);
  }
  std::shared_ptr<Linear> l1, l2, l3;
  std::shared_ptr<Dropout> drop;
};

struct Grads {
  std::vector<std::vector<double>> params;
  std::vector<double> input;
  std::vector<double> output;
  uint64_t counter_after_forward = 0;
  uint64_t counter_after_backward = 0;
};

// Forward (checkpointed or not) from generator counter 0, backward of a weighted sum.
Grads run(Mlp& m, Generator& gen, Generator* ckpt_gen, bool use_checkpoint) {
  m.zero_grad();
  gen.set_counter(0);
  Tensor x = randn({8, 16}, RngKey(1, "x")).set_requires_grad(true);
  Tensor y = use_checkpoint ? checkpoint([&](const Tensor& t) { return m(t); }, x, ckpt_gen) : m(x);
  const uint64_t after_forward = gen.counter();
  Tensor w = randn({8, 4}, RngKey(2, "w"));
  (y * w).sum().backward();
  Grads g;
  g.counter_after_forward = after_forward;
  g.counter_after_backward = gen.counter();
  for (const Tensor& p : m.parameters()) g.params.push_back(p.grad().to_vector());
  g.input = x.grad().to_vector();
  g.output = y.to_vector();
  return g;
}

}  // namespace

TEST_CASE("checkpoint: gradients of an MLP with dropout are bit-identical with and without it") {
  Generator gen(7);
  Mlp m(&gen);
  m.init_weights(0);
  Grads plain = run(m, gen, nullptr, false);
  Grads ckpt = run(m, gen, &gen, true);
  CHECK(ckpt.output == plain.output);
  CHECK(ckpt.input == plain.input);
  CHECK(ckpt.counter_after_forward == 2);  // two dropout draws
  CHECK(ckpt.counter_after_backward == 2);  // the replay leaves the generator where forward left it
  REQUIRE(ckpt.params.size() == plain.params.size());
  for (size_t i = 0; i < plain.params.size(); ++i) CHECK(ckpt.params[i] == plain.params[i]);

  // Control: replaying the wrong generator draws fresh masks, and the gradients change.
  Generator unrelated(99);
  Grads wrong = run(m, gen, &unrelated, true);
  CHECK(wrong.output == plain.output);
  CHECK(wrong.input != plain.input);
}

TEST_CASE("checkpoint: dropout on the default generator replays without naming a generator") {
  Mlp m(nullptr);  // draws from default_generator()
  m.init_weights(1);
  Grads plain = run(m, default_generator(), nullptr, false);
  Grads ckpt = run(m, default_generator(), nullptr, true);
  CHECK(ckpt.input == plain.input);
  for (size_t i = 0; i < plain.params.size(); ++i) CHECK(ckpt.params[i] == plain.params[i]);
}

TEST_CASE("checkpoint: parameters inside get gradients and hooks even when no input requires grad") {
  Linear lin(3, 2);
  lin.init_weights(0);
  int fired = 0;
  std::vector<double> seen;
  Tensor w = lin.weight();
  w.register_post_accumulate_grad_hook([&](Tensor& leaf) {
    ++fired;
    seen = leaf.grad().to_vector();
  });
  Tensor x = randn({4, 3}, RngKey(0, "x"));  // plain data, as the first block sees
  Tensor y = checkpoint([&](const Tensor& t) { return lin(t); }, x);
  CHECK(y.requires_grad());
  y.sum().backward();
  CHECK(fired == 1);
  REQUIRE(w.grad().defined());
  CHECK(seen == w.grad().to_vector());
  // d sum(x W^T + b) / dW = column sums of x, per output row.
  const auto want = sum(x, {0}).unsqueeze(0).expand({2, 3}).to_vector();
  const auto got = w.grad().to_vector();
  for (size_t i = 0; i < want.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-6));
  CHECK(lin.bias().grad().to_vector() == std::vector<double>{4, 4});
}

TEST_CASE("checkpoint: several inputs and outputs, unused outputs and non-grad inputs") {
  Tensor a = from_vector({1, 2}, {2}, {.dtype = DType::f64, .requires_grad = true});
  Tensor b = from_vector({3, 4}, {2}, {.dtype = DType::f64, .requires_grad = true});
  Tensor c = from_vector({5, 6}, {2}, {.dtype = DType::f64});
  int calls = 0;
  auto outs = checkpoint(
      [&](const std::vector<Tensor>& in) {
        ++calls;
        return std::vector<Tensor>{in[0] * in[1], in[1] * in[2], in[0]};
      },
      {a, b, c});
  CHECK(calls == 1);
  REQUIRE(outs.size() == 3);
  CHECK(outs[0].to_vector() == std::vector<double>{3, 8});
  CHECK_FALSE(outs[2].is_same(a));
  outs[0].sum().backward();  // outputs 1 and 2 unused: their gradients are zeros
  CHECK(calls == 2);
  CHECK(a.grad().to_vector() == std::vector<double>{3, 4});
  CHECK(b.grad().to_vector() == std::vector<double>{1, 2});
  CHECK_FALSE(c.grad().defined());
}

TEST_CASE("checkpoint: under NoGradGuard it is a plain call that records nothing") {
  Tensor x = from_vector({1, 2}, {2}, {.requires_grad = true});
  NoGradGuard ng;
  Tensor y = checkpoint([](const Tensor& t) { return t * 2.0; }, x);
  CHECK_FALSE(y.requires_grad());
  CHECK(y.to_vector() == std::vector<double>{2, 4});
}

TEST_CASE("checkpoint: a recomputation that differs from the forward is an error naming the shapes") {
  Tensor x = from_vector({1, 2, 3, 4}, {4}, {.requires_grad = true});
  int calls = 0;
  Tensor y = checkpoint([&](const Tensor& t) { return ++calls == 1 ? t * 2.0 : t.narrow(0, 0, 2) * 2.0; }, x);
  CHECK_THROWS_WITH_AS(y.sum().backward(), doctest::Contains("[checkpoint] recomputed output 0 has shape (2,), the forward had (4,)"),
                       Error);
}

TEST_CASE("checkpoint: peak memory of a checkpointed forward is measurably lower") {
  constexpr int kLayers = 12;
  constexpr int64_t kWidth = 256, kBatch = 512;
  Sequential stack;
  for (int i = 0; i < kLayers; ++i) stack.push_back(std::make_shared<Linear>(kWidth, kWidth));
  stack.init_weights(0);
  auto block = [&](const Tensor& t) {
    Tensor h = t;
    for (const auto& l : stack) h = tanh((*l)(h));
    return h;
  };
  Tensor x = randn({kBatch, kWidth}, RngKey(0, "x"));

  auto forward_peak = [&](bool ckpt, std::vector<double>* grad_out) {
    stack.zero_grad();
    const int64_t base = cpu_memory_stats().allocated;
    reset_cpu_peak_memory();
    Tensor y = ckpt ? checkpoint(block, x) : block(x);
    const int64_t peak = cpu_memory_stats().peak_allocated - base;
    const int64_t held = cpu_memory_stats().allocated - base;  // what the graph keeps alive
    y.sum().backward();
    *grad_out = stack.at<Linear>(0).weight().grad().to_vector();
    return std::pair<int64_t, int64_t>{peak, held};
  };
  std::vector<double> g_plain, g_ckpt;
  auto [peak_plain, held_plain] = forward_peak(false, &g_plain);
  auto [peak_ckpt, held_ckpt] = forward_peak(true, &g_ckpt);
  const int64_t activation = kBatch * kWidth * 4;
  MESSAGE("forward peak: plain " << peak_plain / 1024 << " KiB, checkpointed " << peak_ckpt / 1024
                                  << " KiB; held after forward: " << held_plain / 1024 << " vs " << held_ckpt / 1024
                                  << " KiB (one activation = " << activation / 1024 << " KiB)");
  CHECK(held_plain >= (kLayers - 1) * activation);  // every layer keeps about one activation
  CHECK(held_ckpt <= 2 * activation);         // the output, and little else
  CHECK(peak_ckpt * 3 < peak_plain);
  CHECK(g_ckpt == g_plain);
}

TEST_CASE("checkpoint: selective mode reuses linear outputs and gives the same gradients") {
  auto build = [] {
    auto seq = std::make_shared<Sequential>();
    seq->push_back(std::make_shared<Linear>(6, 12));
    seq->push_back(std::make_shared<Linear>(12, 5));
    seq->init_weights(11);
    return seq;
  };
  Tensor x = randn({4, 6}, RngKey(3, "x"));
  auto run = [&](std::optional<CheckpointMode> mode) {
    auto seq = build();
    auto f = [&](const Tensor& in) { return tanh((*seq)(in)); };
    Tensor xi = x.clone().set_requires_grad(true);
    Tensor y = mode ? checkpoint(f, xi, nullptr, *mode) : f(xi);
    sum(square(y)).backward();
    std::vector<std::vector<double>> g{xi.grad().to_vector()};
    for (const Tensor& p : seq->parameters()) g.push_back(p.grad().to_vector());
    return g;
  };
  const auto plain = run(std::nullopt);
  CHECK(run(CheckpointMode::full) == plain);
  CHECK(run(CheckpointMode::save_matmuls) == plain);
}

TEST_CASE("checkpoint: selective mode does not recompute the matmuls") {
  // The kept outputs stand in for the linear layers during recomputation: changing a weight
  // between forward and backward leaves the recomputed activations (and so the input
  // gradient's nonlinearity factor) at the forward's values, unlike full recomputation.
  auto lin = std::make_shared<Linear>(3, 3, false);
  lin->init_weights(5);
  Tensor x = randn({2, 3}, RngKey(1, "x")).set_requires_grad(true);
  Tensor y = checkpoint([&](const Tensor& in) { return tanh((*lin)(in)); }, x, nullptr, CheckpointMode::save_matmuls);
  Tensor expected_act = tanh(linear(x.detach(), lin->weight().detach()));
  {
    NoGradGuard ng;
    lin->parameter("weight").fill_(0.0);  // a full recomputation would now see zeros
  }
  sum(y).backward();
  // d/dx sum(tanh(x W^T)) = (1 - tanh^2) W; with W now zero the W factor is zero, but the
  // weight gradient (1 - act^2)^T x uses the kept activations: nonzero only if they were kept.
  Tensor gw = lin->weight().grad();
  Tensor want = matmul(transpose(1.0 - square(expected_act), 0, 1), x.detach());
  // Equal up to the GEMM library's rounding (backward may multiply in another transpose mode).
  const auto got_v = gw.to_vector(), want_v = want.to_vector();
  REQUIRE(got_v.size() == want_v.size());
  for (size_t i = 0; i < got_v.size(); ++i) {
    CHECK(want_v[i] != 0.0);
    CHECK(got_v[i] == doctest::Approx(want_v[i]).epsilon(1e-6));
  }
}
