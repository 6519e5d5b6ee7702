// What the CUDA benchmark files share: the H200 ceilings, the stream, timing of `reps`
// launches per iteration, and registration. A file adds its cases at static-init time; the
// cuda_bench main registers them once it knows a device is usable, and prints one table.
//
//   void register_mine() { reg("my_kernel/" + shape_of({n}), [](benchmark::State& s) { ... }); }
//   const Registrar mine(register_mine);
#pragma once

#include <benchmark/benchmark.h>

#include <chrono>
#include <initializer_list>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace quilt::cuda_bench {

constexpr double kPeakBf16Tflops = 790.0;  // dense bf16 GEMM measured on an H200
constexpr double kPeakF32Tflops = 67.0;    // f32 without TF32, datasheet
constexpr double kPeakGBps = 4300.0;       // device copy, bytes read + written
inline const Device kGpu = Device::cuda(0);

/// The current stream of the GPU, as kernels take it.
inline void* stream() { return current_stream(kGpu).handle; }

// Times `reps` launches per iteration and sets the per-launch time, the rate and pct_peak.
// `work` is FLOPs (tflops = true) or bytes moved per launch.
template <class F>
void timed(benchmark::State& state, int reps, double work, bool tflops, double peak, F&& launch) {
  launch();  // warm-up: cuBLAS heuristics, first-touch of pages
  synchronize(current_stream(kGpu));
  double total = 0;
  int64_t launches = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) launch();
    synchronize(current_stream(kGpu));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(dt / reps);
    total += dt;
    launches += reps;
  }
  const double per = total / double(launches);
  const double rate = tflops ? work / per / 1e12 : work / per / 1e9;
  state.counters[tflops ? "TFLOPs" : "GBps"] = rate;
  state.counters["pct_peak"] = 100.0 * rate / peak;
}

/// Normal random numbers on the GPU (never zeros: they time faster than real data).
inline Tensor dev_randn(const Shape& s, DType dt, const char* key) {
  return randn(s, RngKey(1, key), {.dtype = dt, .device = kGpu});
}

/// "4096x4096x4096" from the dims.
inline std::string shape_of(std::initializer_list<int64_t> dims) {
  std::string s;
  for (int64_t d : dims) s += (s.empty() ? "" : "x") + std::to_string(d);
  return s;
}

/// Registers a manually timed benchmark reporting microseconds.
template <class F>
void reg(const std::string& name, F fn) {
  benchmark::RegisterBenchmark(name.c_str(), fn)->UseManualTime()->Unit(benchmark::kMicrosecond);
}

/// The registration functions of every file, run by main after the device check.
std::vector<void (*)()>& registry();
struct Registrar {
  explicit Registrar(void (*fn)()) { registry().push_back(fn); }
};

}  // namespace quilt::cuda_bench
