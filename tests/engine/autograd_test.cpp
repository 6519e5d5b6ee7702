// Autograd engine: accumulation, retain_graph, grad mode, detach, retain_grad, hooks,
// grad(), graph shapes, and the errors that guard misuse.
#include <doctest/doctest.h>

#include "engine/engine.h"

using namespace quilt;

namespace {

Tensor vec(std::vector<double> v, bool grad = true) {
  const int64_t n = int64_t(v.size());
  return from_vector(v, {n}, {.dtype = DType::f64, .requires_grad = grad});
}

}  // namespace

TEST_CASE("autograd: a leaf accumulates gradients across two backward calls") {
  Tensor x = vec({1, -2, 3});
  (x * x).sum().backward();
  CHECK(x.grad().to_vector() == std::vector<double>{2, -4, 6});
  (x * 3.0).sum().backward();
  CHECK(x.grad().to_vector() == std::vector<double>{5, -1, 9});
  CHECK_FALSE(x.grad().requires_grad());
}

TEST_CASE("autograd: a second backward needs retain_graph, and with it gradients double") {
  Tensor x = vec({1, 2});
  Tensor y = (x * x).sum();
  y.backward();
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("a second time"), Error);
  try {
    y.backward();
  } catch (const Error& e) {
    // The message names the op whose saved tensors are gone.
    const std::string msg = e.what();
    CHECK((msg.find("'mul'") != std::string::npos || msg.find("'sum'") != std::string::npos));
  }

  Tensor a = vec({1, 2});
  Tensor z = (a * a).sum();
  z.backward({}, /*retain_graph=*/true);
  CHECK(a.grad().to_vector() == std::vector<double>{2, 4});
  z.backward();
  CHECK(a.grad().to_vector() == std::vector<double>{4, 8});
}

TEST_CASE("autograd: under NoGradGuard no graph is recorded and results do not require grad") {
  Tensor x = vec({1, 2});
  CHECK(grad_enabled());
  {
    NoGradGuard ng;
    CHECK_FALSE(grad_enabled());
    Tensor y = x * 2.0 + 1.0;
    CHECK_FALSE(y.requires_grad());
    CHECK(y.is_leaf());
    CHECK(y.grad_fn() == nullptr);
    {
      EnableGradGuard eg;
      CHECK((x * 2.0).requires_grad());
    }
    CHECK_FALSE(grad_enabled());
  }
  CHECK(grad_enabled());
  CHECK((x * 2.0).requires_grad());
}

TEST_CASE("autograd: detach shares data but cuts the graph") {
  Tensor x = vec({1, 2, 3});
  Tensor y = x * 2.0;
  Tensor d = y.detach();
  CHECK_FALSE(d.requires_grad());
  CHECK(d.is_leaf());
  CHECK(d.storage().id() == y.storage().id());
  // Gradient flows only through the attached path.
  Tensor loss = (y * d).sum();
  loss.backward();
  CHECK(x.grad().to_vector() == std::vector<double>{4, 8, 12});  // d/dx (2x * const 2x) = 2 * d
}

TEST_CASE("autograd: retain_grad keeps the gradient of a non-leaf") {
  Tensor x = vec({1, 2});
  Tensor h = x * 3.0;
  h.retain_grad();
  Tensor other = x * 5.0;  // not retained
  (h * h + other).sum().backward();
  REQUIRE(h.grad().defined());
  CHECK(h.grad().to_vector() == std::vector<double>{6, 12});  // 2h
  CHECK_FALSE(other.grad().defined());
  CHECK(x.grad().to_vector() == std::vector<double>{23, 41});  // 3 * 2h + 5
}

TEST_CASE("autograd: tensor hooks on leaves and non-leaves can replace the gradient") {
  Tensor x = vec({1, 2});
  Tensor h = x * 2.0;
  std::vector<double> seen_h;
  h.register_hook([&](const Tensor& g) {
    seen_h = g.to_vector();
    return g * 10.0;  // replaces what flows on to x
  });
  int leaf_calls = 0;
  x.register_hook([&](const Tensor& g) {
    ++leaf_calls;
    return g + 1.0;
  });
  Tensor observer = vec({0, 0});
  observer.register_hook([](const Tensor&) { return Tensor(); });  // undefined: keep the gradient
  (h.sum() + (observer * 3.0).sum()).backward();
  CHECK(seen_h == std::vector<double>{1, 1});
  CHECK(leaf_calls == 1);
  CHECK(x.grad().to_vector() == std::vector<double>{21, 21});  // 1 * 10 * 2 + 1
  CHECK(observer.grad().to_vector() == std::vector<double>{3, 3});
}

TEST_CASE("autograd: post-accumulate-grad hooks fire once per backward after .grad is set") {
  Tensor x = vec({1, 2});
  std::vector<std::vector<double>> seen;
  x.register_post_accumulate_grad_hook([&](Tensor& leaf) { seen.push_back(leaf.grad().to_vector()); });
  // x reaches the loss along two paths; the hook still fires once, with the sum.
  (x * x + x * 4.0).sum().backward();
  REQUIRE(seen.size() == 1);
  CHECK(seen[0] == std::vector<double>{6, 8});
  (x * 1.0).sum().backward();
  REQUIRE(seen.size() == 2);
  CHECK(seen[1] == std::vector<double>{7, 9});  // sees the accumulated value
  Tensor nonleaf = x * 2.0;
  CHECK_THROWS_AS(nonleaf.register_post_accumulate_grad_hook([](Tensor&) {}), Error);
}

TEST_CASE("autograd: grad() returns gradients without touching .grad") {
  Tensor x = vec({1, 2, 3});
  Tensor w = vec({2, 2, 2});
  Tensor y = (x * x * w).sum();
  auto gs = grad({y}, {x, w});
  REQUIRE(gs.size() == 2);
  CHECK(gs[0].to_vector() == std::vector<double>{4, 8, 12});
  CHECK(gs[1].to_vector() == std::vector<double>{1, 4, 9});
  CHECK_FALSE(x.grad().defined());
  CHECK_FALSE(w.grad().defined());

  // A non-leaf input and an unreachable input.
  Tensor a = vec({1, 2});
  Tensor h = a * 3.0;
  Tensor unused = vec({5});
  auto g2 = grad({(h * h).sum()}, {h, unused});
  CHECK(g2[0].to_vector() == std::vector<double>{6, 12});
  CHECK_FALSE(g2[1].defined());
  CHECK_FALSE(a.grad().defined());
}

TEST_CASE("autograd: grad() applies hooks registered on a leaf input") {
  Tensor x = vec({1, 2});
  x.register_hook([](const Tensor& g) { return g * 2.0; });
  auto gs = grad({(x * 3.0).sum()}, {x});
  CHECK(gs[0].to_vector() == std::vector<double>{6, 6});
  CHECK_FALSE(x.grad().defined());
}

TEST_CASE("autograd: a diamond graph sums the contributions of both paths") {
  Tensor x = vec({1, 2, 3});
  Tensor a = x * 2.0;    // da/dx = 2
  Tensor b = x * x;      // db/dx = 2x
  Tensor c = a * b;      // x used through both a and b: d(2x^3)/dx = 6x^2
  c.sum().backward();
  CHECK(x.grad().to_vector() == std::vector<double>{6, 24, 54});

  Tensor y = vec({1, 2});
  (y + y).sum().backward();  // the same tensor twice in one op
  CHECK(y.grad().to_vector() == std::vector<double>{2, 2});
}

TEST_CASE("autograd: backward of a non-scalar needs a gradient, and uses the one given") {
  Tensor x = vec({1, 2, 3});
  Tensor y = x * 2.0;
  CHECK_THROWS_WITH_AS(y.backward(), doctest::Contains("a gradient must be given for a non-scalar output of shape (3,)"),
                       Error);
  Tensor x2 = vec({1, 2, 3});
  (x2 * 2.0).backward(vec({1, 10, 100}, false));
  CHECK(x2.grad().to_vector() == std::vector<double>{2, 20, 200});
  CHECK_THROWS_WITH_AS((x2 * 2.0).backward(vec({1, 2}, false)), doctest::Contains("gradient shape (2,)"), Error);
}

TEST_CASE("autograd: only floating leaves can require grad") {
  Tensor i = arange(0, 4);
  CHECK_THROWS_WITH_AS(i.set_requires_grad(true), doctest::Contains("only floating tensors can require grad, got i64"),
                       Error);
  Tensor x = vec({1, 2});
  Tensor y = x * 2.0;
  CHECK_THROWS_WITH_AS(y.set_requires_grad(false), doctest::Contains("[requires_grad] can only be set on leaf tensors"),
                       Error);
  CHECK_THROWS_WITH_AS((vec({1}, false) * 2.0).sum().backward(), doctest::Contains("does not require grad"), Error);
}

TEST_CASE("autograd: in-place updates of a tensor requiring grad are refused while grad mode is on") {
  Tensor x = vec({1, 2});
  Tensor one = vec({1, 1}, false);
  CHECK_THROWS_WITH_AS(x.add_(one), doctest::Contains("[add_] in-place update of a tensor that requires grad"), Error);
  CHECK_THROWS_AS(x.mul_(2.0), Error);
  CHECK_THROWS_AS(x.copy_(one), Error);
  CHECK(x.to_vector() == std::vector<double>{1, 2});
  {
    NoGradGuard ng;
    x.add_(one, -0.5);
  }
  CHECK(x.to_vector() == std::vector<double>{0.5, 1.5});
}

TEST_CASE("autograd: backward split into inputs then weights accumulates what one backward does") {
  // x -> linear(w1) -> tanh -> linear(w2), w1 also scaled into an extra term: weights reach
  // the loss both through ops that feed the input side (matmul) and on their own.
  auto make = [](uint64_t seed) {
    std::vector<Tensor> t;
    for (Shape s : {Shape{4, 3}, Shape{3, 5}, Shape{5, 2}})
      t.push_back(randn(s, RngKey(seed++, "t"), {.dtype = DType::f64}).set_requires_grad(true));
    return t;
  };
  auto loss_of = [](const std::vector<Tensor>& t) {
    Tensor h = tanh(matmul(t[0], t[1]));
    return (matmul(h, t[2]) * matmul(h, t[2])).sum() + (t[1] * t[1]).sum() * 0.5;
  };
  std::vector<Tensor> whole = make(7), split = make(7);
  loss_of(whole).backward();

  DeferredBackward rest = backward_inputs({loss_of(split)}, {}, {split[0]});
  REQUIRE(split[0].grad().defined());
  CHECK_FALSE(split[1].grad().defined());  // weight gradients wait for backward_weights
  CHECK_FALSE(split[2].grad().defined());
  CHECK(split[0].grad().to_vector() == whole[0].grad().to_vector());
  CHECK_FALSE(rest.empty());
  backward_weights(std::move(rest));
  for (int i = 1; i < 3; ++i) {
    REQUIRE(split[i].grad().defined());
    const auto a = split[i].grad().to_vector(), b = whole[i].grad().to_vector();
    for (size_t j = 0; j < a.size(); ++j) CHECK(a[j] == doctest::Approx(b[j]).epsilon(1e-14));
  }
}

TEST_CASE("autograd: a split backward whose inputs do not reach the loss leaves everything for the weights") {
  Tensor x = vec({1, 2});
  Tensor w = vec({3, 4});
  Tensor unused = vec({5});
  DeferredBackward rest = backward_inputs({(w * w).sum() + (x * 0.0).sum() * 0.0}, {}, {unused});
  CHECK_FALSE(unused.grad().defined());
  CHECK_FALSE(w.grad().defined());
  backward_weights(std::move(rest));
  CHECK(w.grad().to_vector() == std::vector<double>{6, 8});
  CHECK(x.grad().to_vector() == std::vector<double>{0, 0});
  CHECK_THROWS_WITH_AS(backward_inputs({(w * 2.0).sum()}, {}, {vec({1}, false)}),
                       "[backward_inputs] every input must require grad", Error);
}
