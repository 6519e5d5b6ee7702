// Softmax, attention and one AdamW step: bandwidth (GB/s) or GFLOP/s, with a plain memcpy of
// the same bytes in the same run as the bandwidth reference.
#include <cstring>

#include "bench/engine/bench_util.h"
#include "engine/engine.h"

using namespace quilt;

static void BM_memcpy_32MiB(benchmark::State& state) {
  const size_t n = size_t(8192) * 1024;
  std::vector<float> a(n, 1.0f), b(n);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), n * sizeof(float));
    benchmark::DoNotOptimize(b.data());
  }
  bench::set_bandwidth(state, 2.0 * double(n) * 4);
}
BENCHMARK(BM_memcpy_32MiB)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_softmax_rows(benchmark::State& state) {
  const int64_t cols = state.range(0);
  const int64_t rows = (int64_t(8192) * 1024) / cols;
  Tensor x = randn({rows, cols}, RngKey(0, "x"));
  for (auto _ : state) {
    Tensor y = softmax(x, -1);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  bench::set_bandwidth(state, 2.0 * double(rows * cols) * 4);
}
BENCHMARK(BM_softmax_rows)->Arg(1024)->Arg(32768)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_cross_entropy(benchmark::State& state) {
  const int64_t rows = 2048, vocab = 4096;
  Tensor logits = randn({rows, vocab}, RngKey(0, "l"));
  Tensor target = randint(0, vocab, {rows}, RngKey(0, "t"));
  for (auto _ : state) {
    Tensor l = cross_entropy(logits, target);
    benchmark::DoNotOptimize(l.data_ptr());
  }
  bench::set_bandwidth(state, double(rows * vocab) * 4);
}
BENCHMARK(BM_cross_entropy)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_rms_norm(benchmark::State& state) {
  Tensor x = randn({8192, 1024}, RngKey(0, "x")), w = ones({1024});
  for (auto _ : state) {
    Tensor y = rms_norm(x, w, 1e-5);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  bench::set_bandwidth(state, 2.0 * 8192 * 1024 * 4);
}
BENCHMARK(BM_rms_norm)->Unit(benchmark::kMillisecond)->UseRealTime();

// Causal attention forward (B=1, H=8, T=S, D=64) through the primitive, which skips the masked
// tiles: 2 matmuls of 2*T*T*D each counted in full, so about twice the useful rate
// (bench/engine/attention_bench.cpp counts useful work and compares with the composite).
static void BM_attention_causal(benchmark::State& state) {
  const int64_t t = state.range(0), h = 8, d = 64;
  Tensor q = randn({1, h, t, d}, RngKey(0, "q")), k = randn({1, h, t, d}, RngKey(0, "k")),
         v = randn({1, h, t, d}, RngKey(0, "v"));
  for (auto _ : state) {
    Tensor y = scaled_dot_product_attention(q, k, v, {}, true);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  bench::set_flops(state, 4.0 * double(h) * double(t) * double(t) * double(d));
}
BENCHMARK(BM_attention_causal)->Arg(256)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

// One AdamW step over 16 Mi f32 parameters: reads param, grad, m, v and writes param, m, v.
static void BM_adamw_step(benchmark::State& state) {
  const int64_t n = int64_t(1) << 24;
  Tensor p = randn({n}, RngKey(0, "p")).set_requires_grad();
  p.set_grad(randn({n}, RngKey(0, "g")));
  AdamW opt(std::vector<Tensor>{p}, AdamWOptions{.lr = 1e-3});
  for (auto _ : state) opt.step();
  bench::set_bandwidth(state, 7.0 * double(n) * 4);
}
BENCHMARK(BM_adamw_step)->Unit(benchmark::kMillisecond)->UseRealTime();

// One SGD step with Nesterov momentum over 16 Mi f32 parameters: reads param, grad, buf and
// writes param, buf.
static void BM_sgd_step(benchmark::State& state) {
  const int64_t n = int64_t(1) << 24;
  Tensor p = randn({n}, RngKey(0, "p")).set_requires_grad();
  p.set_grad(randn({n}, RngKey(0, "g")));
  SGD opt(std::vector<Tensor>{p}, SGDOptions{.lr = 1e-3, .momentum = 0.9, .weight_decay = 1e-4, .nesterov = true});
  for (auto _ : state) opt.step();
  bench::set_bandwidth(state, 5.0 * double(n) * 4);
}
BENCHMARK(BM_sgd_step)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
