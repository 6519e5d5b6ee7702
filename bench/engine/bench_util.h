// Shared helpers for the engine benchmarks: bandwidth/FLOP counters and a memcpy baseline.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace quilt::bench {

/// Reports bytes moved per iteration as GB/s (decimal, as nccl-tests and STREAM do).
inline void set_bandwidth(benchmark::State& state, double bytes_per_iter) {
  state.counters["GBps"] = benchmark::Counter(bytes_per_iter / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

/// Reports floating-point operations per iteration as GFLOP/s.
inline void set_flops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOPs"] = benchmark::Counter(flops_per_iter / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace quilt::bench
