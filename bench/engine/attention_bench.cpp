// Causal attention (B = 1, H = 8, D = 64, S = T): the fused primitive against the composite of
// matmul/softmax/where it replaced, forward and forward + backward, in GFLOP/s of useful work
// (a causal mask counts half the matrix: forward 2 GEMMs of 2·T·T·D, backward 2.5x that), with
// a large f32 GEMM in the same run as the machine's ceiling.
//
//   attention_bench --benchmark_min_time=0.05 --benchmark_filter='forward/T:1024'
#include "bench/engine/bench_util.h"
#include "engine/engine.h"

using namespace quilt;

namespace {

constexpr int64_t kHeads = 8, kHeadDim = 64;

double forward_flops(int64_t t) { return 0.5 * 4.0 * double(kHeads) * double(t) * double(t) * double(kHeadDim); }

struct Inputs {
  Tensor q, k, v, g;
  explicit Inputs(int64_t t, bool grad) {
    const Shape s{1, kHeads, t, kHeadDim};
    q = randn(s, RngKey(0, "q"), {.requires_grad = grad});
    k = randn(s, RngKey(0, "k"), {.requires_grad = grad});
    v = randn(s, RngKey(0, "v"), {.requires_grad = grad});
    g = randn(s, RngKey(0, "g"));
  }
};

// Args: T, and 1 for the composite.
void BM_attention_forward(benchmark::State& state) {
  const int64_t t = state.range(0);
  const Inputs x(t, false);
  const AttentionOptions o{.causal = true, .composite = state.range(1) != 0};
  for (auto _ : state) {
    const AttentionOutput r = scaled_dot_product_attention(x.q, x.k, x.v, o);
    benchmark::DoNotOptimize(r.out.data_ptr());
  }
  bench::set_flops(state, forward_flops(t));
}

void BM_attention_forward_backward(benchmark::State& state) {
  const int64_t t = state.range(0);
  const Inputs x(t, true);
  const AttentionOptions o{.causal = true, .composite = state.range(1) != 0};
  for (auto _ : state) {
    const AttentionOutput r = scaled_dot_product_attention(x.q, x.k, x.v, o);
    const std::vector<Tensor> g = grad({r.out}, {x.q, x.k, x.v}, {x.g});
    benchmark::DoNotOptimize(g[0].data_ptr());
  }
  bench::set_flops(state, 3.5 * forward_flops(t));
}

// The ceiling: one 2048^3 f32 GEMM through the engine's chosen library.
void BM_gemm_f32_2048(benchmark::State& state) {
  const int64_t n = 2048;
  const Tensor a = randn({n, n}, RngKey(0, "a")), b = randn({n, n}, RngKey(0, "b"));
  for (auto _ : state) {
    const Tensor c = matmul(a, b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_flops(state, 2.0 * double(n) * double(n) * double(n));
}

void sizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "composite"})->ArgsProduct({{256, 512, 1024, 2048, 4096}, {0, 1}});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_gemm_f32_2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_attention_forward)->Apply(sizes);
BENCHMARK(BM_attention_forward_backward)->Apply(sizes);

BENCHMARK_MAIN();
