// Tensor parallelism by plan: a tiny Llama under tp 2 (with and without sequence and loss
// parallelism) gives the one-rank logits, loss and gradients; bad plans are refused by name;
// every primitive of the step has a sharding rule.
#include <doctest/doctest.h>

#include "collectives/communicator.h"
#include "dtensor/dispatch.h"
#include "models/llama/parallelize.h"
#include "parallel/tensor_parallel.h"
#include "tests/parallel/tiny_llama.h"

using namespace quilt;
using namespace quilt::test;

namespace {

struct Batch {
  Tensor tokens = randint(0, 50, {2, 8}, RngKey(11, "tokens"));
  Tensor targets = randint(0, 50, {2, 8}, RngKey(11, "targets"));
};

StepResult one_rank(const LlamaConfig& cfg, const Batch& b) {
  LlamaForCausalLM m(cfg);
  m.init_weights(5);
  return llama_step(m, b.tokens, b.targets);
}

// The step on every rank of a tp group of 2 under `plan`; rank 0's result (they agree).
StepResult tp2(const LlamaConfig& cfg, const Batch& b, bool sp, bool lp) {
  StepResult out;
  run_threads_group(2, [&](Communicator& c) {
    DistributedConfig dc;
    dc.tp_size = 2;
    dc.sequence_parallel = sp;
    const Meshes meshes = ParallelDims(dc, 2).build_meshes(c.shared_from_this());
    LlamaForCausalLM m(cfg);
    m.init_weights(5);
    apply_tp(m, meshes["tp"], llama_tp_plan_for(m, sp, lp));
    CHECK(m.parameter("model.layers.0.self_attn.q_proj.weight").is_distributed());
    StepResult r = llama_step(m, b.tokens, b.targets);
    CHECK(r.logits_distributed == lp);
    if (c.rank() == 0) out = r;
  });
  return out;
}

}  // namespace

TEST_CASE("tensor_parallel: a tiny Llama under tp 2 gives the one-rank logits, loss and gradients") {
  const Batch b;
  const StepResult ref = one_rank(tiny_llama(), b);
  for (bool sp : {false, true})
    for (bool lp : {false, true}) {
      CAPTURE(sp);
      CAPTURE(lp);
      const StepResult r = tp2(tiny_llama(), b, sp, lp);
      CHECK(r.grads.size() == ref.grads.size());
      CHECK(worst_diff(r, ref) < 1e-5);
    }
}

TEST_CASE("tensor_parallel: tied embeddings under tp 2 compute the logits from the vocab-parallel embedding") {
  const Batch b;
  const StepResult ref = one_rank(tiny_llama(true), b);
  for (bool sp : {false, true})
    for (bool lp : {false, true}) {
      CAPTURE(sp);
      CAPTURE(lp);
      CHECK(worst_diff(tp2(tiny_llama(true), b, sp, lp), ref) < 1e-5);
    }
}

TEST_CASE("tensor_parallel: the Llama plan lays parameters out colwise, rowwise and vocab-parallel") {
  run_threads_group(2, [](Communicator& c) {
    const DeviceMesh tp = DeviceMesh::one_d(c.shared_from_this(), "tp");
    LlamaForCausalLM m(tiny_llama());
    m.init_weights(1);
    apply_tp(m, tp, llama_tp_plan(/*sequence_parallel=*/true, /*loss_parallel=*/true));
    auto placement = [&](const std::string& n) { return str(placements_of(m.parameter(n))); };
    CHECK(placement("model.embed_tokens.weight") == "(S(0))");
    CHECK(placement("model.layers.1.self_attn.q_proj.weight") == "(S(0))");
    CHECK(placement("model.layers.1.self_attn.o_proj.weight") == "(S(1))");
    CHECK(placement("model.layers.0.mlp.down_proj.weight") == "(S(1))");
    CHECK(placement("model.layers.0.input_layernorm.weight") == "(R)");  // SP norms: replicated
    CHECK(placement("model.norm.weight") == "(R)");
    CHECK(placement("lm_head.weight") == "(S(0))");
    CHECK(m.parameter("model.layers.0.mlp.up_proj.weight").name() == "model.layers.0.mlp.up_proj.weight");
    CHECK(m.parameter("model.layers.0.mlp.up_proj.weight").local().shape() == Shape{24, 32});
  });
}

TEST_CASE("tensor_parallel: a plan entry that names no module, or a style that does not fit, is refused by name") {
  run_threads_group(2, [](Communicator& c) {
    const DeviceMesh tp = DeviceMesh::one_d(c.shared_from_this(), "tp");
    LlamaForCausalLM m(tiny_llama());
    TensorParallelPlan plan = llama_tp_plan(false, false);
    plan.add("model.layers.*.self_atn.q_proj", ColwiseParallel{});
    CHECK_THROWS_WITH_AS(apply_tp(m, tp, plan),
                         doctest::Contains("plan entry 'model.layers.*.self_atn.q_proj' (ColwiseParallel) matches no module"),
                         Error);
    CHECK_FALSE(m.parameter("model.layers.0.self_attn.q_proj.weight").is_distributed());  // nothing changed
    TensorParallelPlan misfit;
    misfit.add("model.layers.*.input_layernorm", RowwiseParallel{});
    CHECK_THROWS_WITH_AS(apply_tp(m, tp, misfit),
                         doctest::Contains("RowwiseParallel on 'model.layers.0.input_layernorm', a RMSNorm"), Error);
    LlamaForCausalLM stage(tiny_llama(), {.first_layer = 1, .embed = false});
    CHECK_THROWS_WITH_AS(apply_tp(stage, tp, llama_tp_plan(false, false)),
                         doctest::Contains("'model.embed_tokens'"), Error);
    CHECK_NOTHROW(apply_tp(stage, tp, llama_tp_plan_for(stage, false, false)));
  });
}

TEST_CASE("tensor_parallel: every primitive of the Llama step under tp 2 (with and without SP) has a sharding rule") {
  set_dtensor_fallback_warnings_printed(true);
  const std::vector<std::string> before = dtensor_fallback_warnings();
  const Batch b;
  for (bool sp : {false, true}) {
    tp2(tiny_llama(), b, sp, /*loss_parallel=*/true);
    tp2(tiny_llama(), b, sp, /*loss_parallel=*/false);
  }
  std::vector<std::string> fresh;
  for (const std::string& w : dtensor_fallback_warnings())
    if (std::find(before.begin(), before.end(), w) == before.end()) fresh.push_back(w);
  std::string list;
  for (const std::string& w : fresh) list += "\n  " + w;
  CHECK_MESSAGE(fresh.empty(), "ops that fell back to replicated inputs:", list);
}
