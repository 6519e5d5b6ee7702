// Activation checkpointing by wrapping modules: full and selective checkpointing of a tiny
// Llama's decoder layers give bit-identical gradients to no checkpointing, alone and under
// tp 2 with sequence parallelism; bad targets are refused by name.
#include <doctest/doctest.h>

#include "collectives/communicator.h"
#include "models/llama/parallelize.h"
#include "parallel/activation_checkpoint.h"
#include "tests/parallel/tiny_llama.h"

using namespace quilt;
using namespace quilt::test;

namespace {

const Tensor& tokens() {
  static const Tensor t = randint(0, 50, {2, 8}, RngKey(21, "tokens"));
  return t;
}
const Tensor& targets() {
  static const Tensor t = randint(0, 50, {2, 8}, RngKey(21, "targets"));
  return t;
}

StepResult run(std::optional<ACMode> mode) {
  LlamaForCausalLM m(tiny_llama());
  m.init_weights(9);
  if (mode) apply_ac(m, {.mode = *mode, .modules = {"model.layers.*"}});
  return llama_step(m, tokens(), targets());
}

}  // namespace

TEST_CASE("activation_checkpoint: full and selective checkpointing of the decoder layers give bit-identical gradients") {
  const StepResult plain = run(std::nullopt);
  for (ACMode mode : {ACMode::full, ACMode::selective}) {
    CAPTURE(int(mode));
    const StepResult ac = run(mode);
    CHECK(ac.logits == plain.logits);
    CHECK(ac.loss == plain.loss);
    CHECK(ac.grads == plain.grads);
  }
}

TEST_CASE("activation_checkpoint: checkpointed layers under tp 2 with sequence parallelism give bit-identical gradients") {
  const Tensor tok = tokens(), tgt = targets();
  for (std::optional<ACMode> mode : {std::optional<ACMode>(), std::optional<ACMode>(ACMode::full),
                                     std::optional<ACMode>(ACMode::selective)}) {
    static StepResult reference;
    StepResult r0;
    run_threads_group(2, [&](Communicator& c) {
      const DeviceMesh tp = DeviceMesh::one_d(c.shared_from_this(), "tp");
      LlamaForCausalLM m(tiny_llama());
      m.init_weights(9);
      apply_tp(m, tp, llama_tp_plan(/*sequence_parallel=*/true, /*loss_parallel=*/true));
      if (mode) apply_ac(m, {.mode = *mode, .modules = {"model.layers.*"}});
      StepResult r = llama_step(m, tok, tgt);
      if (c.rank() == 0) r0 = r;
    });
    if (!mode) {
      reference = r0;
      continue;
    }
    CAPTURE(int(*mode));
    CHECK(r0.loss == reference.loss);
    CHECK(r0.grads == reference.grads);
  }
}

TEST_CASE("activation_checkpoint: a pattern that names nothing, a module wrapped twice and an unknown mode are refused") {
  LlamaForCausalLM m(tiny_llama());
  CHECK_THROWS_WITH_AS(apply_ac(m, {.modules = {"model.layer.*"}}),
                       doctest::Contains("pattern 'model.layer.*' matches no module"), Error);
  apply_ac(m, {.modules = {"model.layers.*"}});
  CHECK_THROWS_WITH_AS(apply_ac(m, {.modules = {"model.layers.1"}}),
                       doctest::Contains("'model.layers.1' (LlamaDecoderLayer) already has a forward wrapper"), Error);
  CHECK(parse_ac_mode("selective") == ACMode::selective);
  CHECK_THROWS_WITH_AS(parse_ac_mode("half"), doctest::Contains("activation_checkpointing_mode 'half'"), Error);
}
