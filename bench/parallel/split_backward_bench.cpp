// The backward split of zero-bubble pipeline schedules: time of backward_inputs (I) and
// backward_weights (W) against one backward (B) of the same Llama stage (the 12M config's
// layers: hidden 512, intermediate 1376, 8 heads over 4 kv heads; hidden states in and out,
// as a middle stage), forward excluded. The split must not redo weight work: I + W <= 1.1 B.
//
//   build/bench/split_backward_bench --benchmark_min_time=1
#include <benchmark/benchmark.h>

#include <chrono>

#include "engine/engine.h"
#include "models/llama/llama.h"

using namespace quilt;

namespace {

LlamaConfig stage_config() {
  LlamaConfig c;
  c.hidden_size = 512;
  c.intermediate_size = 1376;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.vocab_size = 320;
  c.max_position_embeddings = 256;
  return c;
}

struct Stage {
  LlamaForCausalLM model{stage_config(), {.embed = false, .head = false}};
  Tensor positions = arange(0, 256, 1, {.dtype = DType::i64});
  Tensor h0 = randn({4, 256, 512}, RngKey(1, "hidden"));
  Stage() { model.init_weights(1); }
  // Forward from a fresh leaf input; returns (loss, input).
  std::pair<Tensor, Tensor> forward() {
    Tensor h = h0.clone().set_requires_grad(true);
    Tensor out = model(h, positions);
    return {(out * out).mean(), h};
  }
};

void BM_Backward(benchmark::State& state) {
  Stage s;
  const bool split = state.range(0) != 0;
  double i_seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (Tensor& p : s.model.parameters()) p.set_grad(Tensor());
    auto [loss, h] = s.forward();
    state.ResumeTiming();
    if (!split) {
      loss.backward();
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      DeferredBackward rest = backward_inputs({loss}, {}, {h});
      i_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      backward_weights(std::move(rest));
    }
  }
  if (split) state.counters["I_ms"] = i_seconds * 1e3 / double(state.iterations());  // of which in I
}

}  // namespace

BENCHMARK(BM_Backward)->Arg(0)->Arg(1)->ArgName("split")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_MAIN();
