// The pipeline runtime on thread ranks: a tiny Llama split into stages and run by a schedule
// gives the losses and gradients of the whole model run on the same micro-batches, including
// micro-batches of different lengths (each transfer carries its shape).
#include <doctest/doctest.h>

#include <mutex>

#include "engine/engine.h"
#include "models/llama/llama.h"
#include "parallel/pipeline/runtime.h"
#include "parallel/pipeline/split.h"
#include "tests/parallel/tiny_llama.h"

using namespace quilt;
using namespace quilt::pipeline;

namespace {

// Micro-batch m: 2 sequences of length 8 + 4 m (lengths differ when `varied`).
std::vector<MicroBatch> batches(int n, bool varied, int64_t vocab) {
  std::vector<MicroBatch> out;
  for (int m = 0; m < n; ++m) {
    const int64_t t = varied ? 8 + 4 * m : 8;
    Tensor tokens = randint(0, vocab, {2, t}, RngKey(uint64_t(10 + m), "tokens"));
    Tensor targets = randint(0, vocab, {2, t}, RngKey(uint64_t(20 + m), "targets"));
    out.push_back({tokens, targets, arange(0, double(t), 1, {.dtype = DType::i64}).unsqueeze(0).expand({2, t}).contiguous()});
  }
  return out;
}

Tensor lm_loss(const Tensor& logits, const Tensor& targets) {
  return cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

// Runs `schedule` over pp thread ranks and checks its loss sum and every parameter's gradient
// against the whole model on the same micro-batches.
void check_against_whole(const std::string& schedule, int pp, int n, bool varied) {
  const LlamaConfig cfg = test::tiny_llama();
  const std::vector<MicroBatch> mbs = batches(n, varied, cfg.vocab_size);
  LlamaForCausalLM whole(cfg);
  whole.init_weights(3);
  double whole_loss = 0;
  for (const MicroBatch& mb : mbs) {
    Tensor loss = lm_loss(whole(mb.tokens, mb.positions), mb.targets);
    loss.backward();
    whole_loss += loss.item<double>();
  }
  const Lowered lists = lower(make_schedule(schedule, pp, n, 2));
  const std::vector<int> ranks = stage_ranks(lists);
  const std::vector<StageSpan> spans = split_layers(cfg.num_hidden_layers, int64_t(ranks.size()));
  std::mutex mu;
  double pipeline_loss = 0;
  std::map<std::string, std::vector<double>> grads;
  run_threads_group(pp, [&](Communicator& c) {
    std::vector<std::shared_ptr<LlamaForCausalLM>> models;
    std::vector<StageRef> refs;
    for (size_t s = 0; s < ranks.size(); ++s) {
      if (ranks[s] != c.rank()) continue;
      const StageSpan& sp = spans[s];
      auto m = std::make_shared<LlamaForCausalLM>(
          cfg, LlamaStage{.first_layer = sp.first_layer, .end_layer = sp.end_layer, .embed = sp.embed, .head = sp.head});
      m->init_weights(3);
      LlamaForCausalLM* raw = m.get();
      refs.push_back({.stage = int(s), .forward = [raw](const Tensor& x, const Tensor& p, const Tensor&) { return (*raw)(x, p); }});
      models.push_back(m);
    }
    PipelineRunner runner(lists, c.shared_from_this(), refs, int(ranks.size()), lm_loss);
    const double loss = runner.run(mbs);
    std::lock_guard lk(mu);
    pipeline_loss += loss;
    for (const auto& m : models)
      for (auto& [name, p] : m->named_parameters()) grads[name] = p.grad().to_vector();
  });
  CHECK(pipeline_loss == doctest::Approx(whole_loss).epsilon(1e-6));
  CHECK(grads.size() == whole.named_parameters().size());
  for (auto& entry : whole.named_parameters()) {  // no structured binding: clang 14 cannot capture one
    auto& name = entry.first;
    auto& p = entry.second;
    const std::vector<double> want = p.grad().to_vector(), got = grads[name];
    REQUIRE_MESSAGE(got.size() == want.size(), name);
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / (std::abs(want[i]) + 1e-4));
    CHECK_MESSAGE(worst < 1e-4, schedule, " ", name, ": relative difference ", worst);
  }
}

}  // namespace

TEST_CASE("pipeline runtime: every schedule at pp 2 gives the whole model's loss and gradients") {
  for (const char* s : {"gpipe", "1f1b", "interleaved1f1b", "looped_bfs", "zero_bubble", "v_schedule"})
    check_against_whole(s, 2, 4, false);
}

TEST_CASE("pipeline runtime: micro-batches of different lengths pass through pp 2") {
  for (const char* s : {"1f1b", "zero_bubble"}) check_against_whole(s, 2, 4, true);
}

TEST_CASE("pipeline runtime: a rank given stages the schedule puts elsewhere is refused") {
  const Lowered lists = lower(make_schedule("1f1b", 2, 2));
  CHECK_THROWS_WITH_AS(run_threads_group(2, [&](Communicator& c) {
    PipelineRunner runner(lists, c.shared_from_this(), {{.stage = 1 - c.rank()}}, 2, lm_loss);
  }), doctest::Contains("but the schedule puts ("), Error);  // rank 0 or 1 fails first
}
