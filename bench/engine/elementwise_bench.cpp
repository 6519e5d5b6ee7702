// Elementwise and reduction bandwidth against a plain memcpy of the same bytes in the same run.
// Bytes counted: every input read once plus the output written once.
#include <cstring>

#include "bench/engine/bench_util.h"
#include "engine/engine.h"

using namespace quilt;

namespace {
constexpr int64_t kN = int64_t(1) << 24;  // 16 Mi f32 = 64 MiB per tensor, far beyond the caches
}

static void BM_memcpy(benchmark::State& state) {
  std::vector<float> a(static_cast<size_t>(kN), 1.0f), b(static_cast<size_t>(kN));
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), size_t(kN) * sizeof(float));
    benchmark::DoNotOptimize(b.data());
  }
  bench::set_bandwidth(state, 2.0 * kN * 4);
}
BENCHMARK(BM_memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_copy_contiguous(benchmark::State& state) {
  Tensor a = ones({kN}), b = empty({kN});
  for (auto _ : state) b.copy_(a);
  bench::set_bandwidth(state, 2.0 * kN * 4);
}
BENCHMARK(BM_copy_contiguous)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_add(benchmark::State& state) {
  Tensor a = ones({kN}), b = ones({kN});
  for (auto _ : state) {
    Tensor c = a + b;
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, 3.0 * kN * 4);
}
BENCHMARK(BM_add)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_add_inplace(benchmark::State& state) {
  Tensor a = ones({kN}), b = ones({kN});
  NoGradGuard ng;
  for (auto _ : state) a.add_(b);
  bench::set_bandwidth(state, 3.0 * kN * 4);
}
BENCHMARK(BM_add_inplace)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_mul_broadcast_row(benchmark::State& state) {
  Tensor a = ones({kN / 4096, 4096}), b = ones({4096});
  for (auto _ : state) {
    Tensor c = a * b;
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, 2.0 * kN * 4);
}
BENCHMARK(BM_mul_broadcast_row)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_exp(benchmark::State& state) {
  Tensor a = randn({kN}, RngKey(0, "a"));
  for (auto _ : state) {
    Tensor c = exp(a);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, 2.0 * kN * 4);
}
BENCHMARK(BM_exp)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_silu(benchmark::State& state) {
  Tensor a = randn({kN}, RngKey(0, "a"));
  for (auto _ : state) {
    Tensor c = silu(a);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, 2.0 * kN * 4);
}
BENCHMARK(BM_silu)->Unit(benchmark::kMillisecond)->UseRealTime();

// bf16 has no Eigen form: a contiguous run is widened to f32 a block at a time, the f32 form run
// on it and the result rounded back.
template <Tensor (*op)(const Tensor&)>
static void BM_unary_bf16(benchmark::State& state) {
  Tensor a = randn({kN}, RngKey(0, "a")).to(DType::bf16);
  for (auto _ : state) {
    Tensor c = op(a);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, 2.0 * kN * 2);
}
static Tensor gelu_of(const Tensor& x) { return gelu(x); }
static Tensor exp_of(const Tensor& x) { return exp(x); }
static Tensor silu_of(const Tensor& x) { return silu(x); }
BENCHMARK(BM_unary_bf16<gelu_of>)->Name("BM_gelu_bf16")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_unary_bf16<exp_of>)->Name("BM_exp_bf16")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_unary_bf16<silu_of>)->Name("BM_silu_bf16")->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_maximum(benchmark::State& state) {
  Tensor a = randn({kN}, RngKey(0, "a")), b = randn({kN}, RngKey(0, "b"));
  for (auto _ : state) {
    Tensor c = maximum(a, b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, 3.0 * kN * 4);
}
BENCHMARK(BM_maximum)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_where(benchmark::State& state) {
  Tensor a = randn({kN}, RngKey(0, "a")), b = randn({kN}, RngKey(0, "b"));
  Tensor cond = gt(a, b);
  for (auto _ : state) {
    Tensor c = where(cond, a, b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, double(kN) * (1 + 4 + 4 + 4));
}
BENCHMARK(BM_where)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_cast_f32_to_bf16(benchmark::State& state) {
  Tensor a = randn({kN}, RngKey(0, "a"));
  for (auto _ : state) {
    Tensor c = a.to(DType::bf16);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, double(kN) * (4 + 2));
}
BENCHMARK(BM_cast_f32_to_bf16)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_transpose_copy(benchmark::State& state) {
  Tensor a = randn({4096, kN / 4096}, RngKey(0, "a"));
  for (auto _ : state) {
    Tensor c = a.transpose(0, 1).contiguous();
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_bandwidth(state, 2.0 * kN * 4);
}
BENCHMARK(BM_transpose_copy)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_sum_all(benchmark::State& state) {
  Tensor a = ones({kN});
  for (auto _ : state) {
    Tensor s = sum(a);
    benchmark::DoNotOptimize(s.data_ptr());
  }
  bench::set_bandwidth(state, double(kN) * 4);
}
BENCHMARK(BM_sum_all)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_sum_rows(benchmark::State& state) {
  Tensor a = ones({kN / 4096, 4096});
  for (auto _ : state) {
    Tensor s = sum(a, {1});
    benchmark::DoNotOptimize(s.data_ptr());
  }
  bench::set_bandwidth(state, double(kN) * 4);
}
BENCHMARK(BM_sum_rows)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_sum_cols(benchmark::State& state) {
  Tensor a = ones({kN / 4096, 4096});
  for (auto _ : state) {
    Tensor s = sum(a, {0});
    benchmark::DoNotOptimize(s.data_ptr());
  }
  bench::set_bandwidth(state, double(kN) * 4);
}
BENCHMARK(BM_sum_cols)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_max_cols(benchmark::State& state) {
  Tensor a = randn({kN / 4096, 4096}, RngKey(0, "a"));
  for (auto _ : state) {
    Tensor s = max(a, {0});
    benchmark::DoNotOptimize(s.data_ptr());
  }
  bench::set_bandwidth(state, double(kN) * 4);
}
BENCHMARK(BM_max_cols)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
