// The backward split of zero-bubble pipeline schedules on real stages: a Llama stage that takes
// hidden states (and one that ends in the head and the loss) gives, through backward_inputs
// then backward_weights, the same input gradient and the same weight gradients as one backward.
#include <doctest/doctest.h>

#include "engine/engine.h"
#include "models/llama/llama.h"
#include "tests/parallel/tiny_llama.h"

using namespace quilt;

namespace {

// One forward of the stage from a leaf hidden-state input; the last stage's loss is cross
// entropy, a middle stage's is a fixed projection of its output (any function of it will do).
Tensor stage_loss(LlamaForCausalLM& m, const Tensor& hidden, const Tensor& targets) {
  const int64_t t = hidden.size(1);
  Tensor out = m(hidden, arange(0, double(t), 1, {.dtype = DType::i64}));
  if (m.has_head()) return cross_entropy(out.view({-1, out.size(-1)}), targets.view({-1}));
  return (out * out).mean();
}

void check_split_equals_whole(const LlamaStage& stage) {
  LlamaConfig cfg = test::tiny_llama();
  LlamaForCausalLM whole(cfg, stage), split(cfg, stage);
  whole.init_weights(5);
  split.init_weights(5);
  const Tensor h0 = randn({2, 16, cfg.hidden_size}, RngKey(3, "hidden"));
  const Tensor targets = randint(0, cfg.vocab_size, {2, 16}, RngKey(4, "targets"));
  Tensor hw = h0.clone().set_requires_grad(true), hs = h0.clone().set_requires_grad(true);

  stage_loss(whole, hw, targets).backward();
  DeferredBackward rest = backward_inputs({stage_loss(split, hs, targets)}, {}, {hs});
  REQUIRE(hs.grad().defined());
  CHECK(hs.grad().to_vector() == hw.grad().to_vector());  // the same ops in the same order
  for (auto& entry : split.named_parameters()) {  // no structured binding: clang 14 cannot capture one
    auto& name = entry.first;
    auto& p = entry.second;
    CHECK_MESSAGE(!p.grad().defined(), name);
  }
  backward_weights(std::move(rest));
  for (auto& entry : split.named_parameters()) {  // no structured binding: clang 14 cannot capture one
    auto& name = entry.first;
    auto& p = entry.second;
    REQUIRE_MESSAGE(p.grad().defined(), name);
    const auto a = p.grad().to_vector(), b = whole.parameter(name).grad().to_vector();
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (std::abs(b[i]) + 1e-6));
    CHECK_MESSAGE(worst < 1e-5, name, ": relative difference ", worst);
  }
}

}  // namespace

TEST_CASE("split backward: a middle Llama stage gives the gradients of one backward") {
  check_split_equals_whole({.first_layer = 0, .end_layer = 2, .embed = false, .head = false});
}

TEST_CASE("split backward: the last Llama stage with head and loss gives the gradients of one backward") {
  check_split_equals_whole({.first_layer = 1, .embed = false});
}
