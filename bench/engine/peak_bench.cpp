// The machine's arithmetic ceiling, the yardstick the GEMM figures are read against: GFLOP/s of
// back-to-back independent fused multiply-adds on the widest registers this build targets
// (512-bit with AVX-512, 256-bit with AVX2 + FMA), and of AVX512-BF16 dot products (vdpbf16ps:
// sixteen lanes, each two bf16 products summed into f32) where the CPU has them. Twelve
// accumulators per thread cover the FMA latency on both pipes, so the loop runs at the issue
// rate; nothing is read from memory.
//   peak_bench                                 # 1 and 2 threads (or --benchmark_filter=...)
#include <immintrin.h>
#include <omp.h>

#include <cstring>
#include <string>

#include "bench/engine/bench_util.h"

namespace {

constexpr int kAcc = 12;
constexpr long kSteps = 1 << 22;  // per thread per iteration: kSteps x kAcc instructions

#if defined(__AVX512F__)
using VecF = __m512;
constexpr int kLanes = 16;
inline VecF splat(float x) { return _mm512_set1_ps(x); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__FMA__)
using VecF = __m256;
constexpr int kLanes = 8;
inline VecF splat(float x) { return _mm256_set1_ps(x); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
#endif

#if defined(__AVX512F__) || defined(__FMA__)
// (Through memory: GCC 12's _mm512_reduce_add_ps warns of an uninitialised register.)
template <class V>
float lane_sum(V v) {
  alignas(64) float f[sizeof(V) / sizeof(float)];
  std::memcpy(f, &v, sizeof v);
  float s = 0;
  for (float x : f) s += x;
  return s;
}

// One thread's kSteps x kAcc FMAs; returns a value that depends on every accumulator.
float fma_run() {
  VecF acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = splat(0.001f * float(i));
  const VecF a = splat(0.999f), b = splat(1e-6f);
  for (long s = 0; s < kSteps; ++s) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) acc[i] = fma(acc[i], a, b);
  }
  float sum = 0;
  for (int i = 0; i < kAcc; ++i) sum += lane_sum(acc[i]);
  return sum;
}
#endif

void BM_fma_f32(benchmark::State& state) {
#if defined(__AVX512F__) || defined(__FMA__)
  const int threads = int(state.range(0));
  float sink = 0;
  for (auto _ : state) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += fma_run();
  }
  benchmark::DoNotOptimize(sink);
  quilt::bench::set_flops(state, 2.0 * kLanes * kAcc * double(kSteps) * threads);
  state.SetLabel(std::to_string(kLanes * 32) + "-bit FMA");
#else
  state.SkipWithError("this build targets no FMA instructions (AVX2 + FMA or AVX-512)");
#endif
}
BENCHMARK(BM_fma_f32)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_dot_bf16(benchmark::State& state) {
#if defined(__AVX512BF16__)
  const int threads = int(state.range(0));
  float sink = 0;
  for (auto _ : state) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      __m512 acc[kAcc];
      for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(0.001f * float(i));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1, 1)
      const __m512bh b = (__m512bh)_mm512_set1_epi32(0x33803380);  // (6e-8, 6e-8)
      for (long s = 0; s < kSteps; ++s) {
#pragma GCC unroll 12
        for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      }
      for (int i = 0; i < kAcc; ++i) sink += lane_sum(acc[i]);
    }
  }
  benchmark::DoNotOptimize(sink);
  // Each vdpbf16ps: 16 lanes x 2 products x (multiply + add).
  quilt::bench::set_flops(state, 64.0 * kAcc * double(kSteps) * threads);
  state.SetLabel("512-bit vdpbf16ps");
#else
  state.SkipWithError("the CPU (or this build) has no AVX512-BF16");
#endif
}
BENCHMARK(BM_dot_bf16)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
