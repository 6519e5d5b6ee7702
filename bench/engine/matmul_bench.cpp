// f32 matmul GFLOP/s: quilt's matmul (Eigen by default, and with QUILT_GEMM=openblas) against
// Eigen and OpenBLAS called directly. The ratio quilt / best library is what docs/PERF.md records.
#include <Eigen/Core>

#include "bench/engine/bench_util.h"
#include "engine/engine.h"
#include "kernels/cpu/matmul.h"
#ifdef QUILT_HAVE_CBLAS
#include <cblas.h>
#endif

using namespace quilt;

static void BM_matmul_quilt(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor a = randn({n, n}, RngKey(1, "a")), b = randn({n, n}, RngKey(1, "b"));
  for (auto _ : state) {
    Tensor c = matmul(a, b);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_flops(state, 2.0 * double(n) * double(n) * double(n));
  state.SetLabel(kernels::cpu::gemm_backend());
}
BENCHMARK(BM_matmul_quilt)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_matmul_quilt_transposed_b(benchmark::State& state) {
  const int64_t n = state.range(0);
  Tensor a = randn({n, n}, RngKey(1, "a")), w = randn({n, n}, RngKey(1, "w"));
  for (auto _ : state) {
    Tensor c = linear(a, w);  // a @ w^T, as every Linear layer runs
    benchmark::DoNotOptimize(c.data_ptr());
  }
  bench::set_flops(state, 2.0 * double(n) * double(n) * double(n));
}
BENCHMARK(BM_matmul_quilt_transposed_b)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_matmul_eigen(benchmark::State& state) {
  const int64_t n = state.range(0);
  using M = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  M a = M::Random(n, n), b = M::Random(n, n), c(n, n);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  bench::set_flops(state, 2.0 * double(n) * double(n) * double(n));
}
BENCHMARK(BM_matmul_eigen)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

#ifdef QUILT_HAVE_CBLAS
static void BM_matmul_quilt_openblas(benchmark::State& state) {
  kernels::cpu::set_gemm_use_blas(true);
  BM_matmul_quilt(state);
  kernels::cpu::set_gemm_use_blas(false);
}
BENCHMARK(BM_matmul_quilt_openblas)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();

static void BM_matmul_openblas_direct(benchmark::State& state) {
  const int n = int(state.range(0));
  std::vector<float> a(size_t(n) * n, 1.0f), b(size_t(n) * n, 0.5f), c(size_t(n) * n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    benchmark::DoNotOptimize(c.data());
  }
  bench::set_flops(state, 2.0 * double(n) * double(n) * double(n));
}
BENCHMARK(BM_matmul_openblas_direct)->Arg(512)->Arg(1024)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
#endif

BENCHMARK_MAIN();
