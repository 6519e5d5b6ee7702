// parallelize_llama: the plan applied from the distributed: section follows the one-rank step;
// the fp32 islands name the norms.
#include <doctest/doctest.h>

#include "collectives/communicator.h"
#include "models/llama/parallelize.h"
#include "tests/parallel/tiny_llama.h"

using namespace quilt;
using namespace quilt::test;

TEST_CASE("parallelize_llama: tp 2 with sequence parallelism and activation checkpointing follows the one-rank step") {
  const Tensor tok = randint(0, 50, {2, 8}, RngKey(31, "tokens")), tgt = randint(0, 50, {2, 8}, RngKey(31, "targets"));
  LlamaForCausalLM ref(tiny_llama());
  ref.init_weights(3);
  const StepResult want = llama_step(ref, tok, tgt);
  for (int world : {1, 2}) {
    CAPTURE(world);
    StepResult got;
    run_threads_group(world, [&](Communicator& c) {
      DistributedConfig dc;
      dc.tp_size = world;
      dc.sequence_parallel = world > 1;
      dc.activation_checkpointing = true;
      dc.activation_checkpointing_mode = "selective";
      const Meshes meshes = ParallelDims(dc, world).build_meshes(c.shared_from_this());
      LlamaForCausalLM m(tiny_llama());
      m.init_weights(3);
      const DataParallelism dp = parallelize_llama(m, meshes, dc);
      CHECK(m.model->layers->at<LlamaDecoderLayer>("0").has_forward_wrapper());
      StepResult r = llama_step(m, tok, tgt, [&] { dp.finish_backward(); });
      if (c.rank() == 0) got = r;
    });
    CHECK(worst_diff(got, want) < 1e-5);
  }
}

TEST_CASE("parallelize_llama: a pipeline stage is parallelized with the plan entries it holds") {
  run_threads_group(2, [](Communicator& c) {
    DistributedConfig dc;
    dc.tp_size = 2;
    const Meshes meshes = ParallelDims(dc, 2).build_meshes(c.shared_from_this());
    LlamaForCausalLM middle(tiny_llama(), {.first_layer = 1, .end_layer = 2, .embed = false, .head = false});
    middle.init_weights(3);
    CHECK_NOTHROW(parallelize_llama(middle, meshes, dc));
    CHECK(middle.parameter("model.layers.1.mlp.down_proj.weight").is_distributed());
  });
}

TEST_CASE("parallelize_llama: the fp32 islands are the norms") {
  LlamaForCausalLM m(tiny_llama());
  std::vector<std::string> islands;
  for (const std::string& s : llama_fp32_modules())
    for (const std::string& n : modules_with_suffix(m, s)) islands.push_back(n);
  CHECK(islands == std::vector<std::string>{"model.layers.0.input_layernorm", "model.layers.1.input_layernorm",
                                            "model.layers.0.post_attention_layernorm",
                                            "model.layers.1.post_attention_layernorm", "model.norm"});
}

TEST_CASE("parallelize_llama: fsdp 2 x tp 2 with sequence parallelism and AC gives the one-rank gradients") {
  const Tensor tok = randint(0, 50, {4, 8}, RngKey(32, "tokens")), tgt = randint(0, 50, {4, 8}, RngKey(32, "targets"));
  LlamaForCausalLM ref(tiny_llama());
  ref.init_weights(4);
  const StepResult want = llama_step(ref, tok, tgt);
  std::vector<StepResult> got(4);
  run_threads_group(4, [&](Communicator& c) {
    DistributedConfig dc;
    dc.tp_size = 2;
    dc.sequence_parallel = true;
    dc.activation_checkpointing = true;
    const ParallelDims dims(dc, 4);
    const Meshes meshes = dims.build_meshes(c.shared_from_this());
    LlamaForCausalLM m(tiny_llama());
    m.init_weights(4);
    const DataParallelism dp = parallelize_llama(m, meshes, dc);
    const int64_t row = dims.dp_rank(c.rank()) * 2;  // this data-parallel rank's half of the batch
    got[size_t(c.rank())] = llama_step(m, tok.narrow(0, row, 2), tgt.narrow(0, row, 2), [&] { dp.finish_backward(); });
  });
  for (const StepResult& r : got) {
    CHECK(r.grads.size() == want.grads.size());
    double worst = 0;
    for (const auto& [name, g] : want.grads) {
      auto it = r.grads.find(name);
      worst = std::max(worst, it == r.grads.end() ? INFINITY : max_diff(g, it->second));
    }
    CHECK(worst < 1e-5);
  }
}
