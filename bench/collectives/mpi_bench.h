// Shared by the benchmarks run under mpirun: rank 0 reports, the other ranks run the same
// benchmarks (so every collective has all its ranks) and print nothing.
//
//   run_benchmarks_on_rank0(world().rank());
#pragma once

#include <benchmark/benchmark.h>
#include <mpi.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <utility>
#include <vector>

namespace quilt {

class SilentReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

/// One timed iteration of `ours` and (when `with_raw`) `raw`, alternating which goes first so
/// neither always inherits the other's cache state; returns the slowest rank's times
/// {ours, raw}, identical on every rank, so all ranks agree on Google Benchmark's iteration count.
template <class Ours, class Raw>
std::pair<double, double> time_against_raw(bool& raw_first, bool with_raw, Ours&& ours, Raw&& raw) {
  auto now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  double t_raw = 0;
  if (with_raw && raw_first) {
    const double t = now();
    raw();
    t_raw = now() - t;
  }
  const double t0 = now();
  ours();
  const double t_ours = now() - t0;
  if (with_raw && !raw_first) {
    const double t = now();
    raw();
    t_raw = now() - t;
  }
  raw_first = !raw_first;
  double times[2] = {t_ours, t_raw};
  MPI_Allreduce(MPI_IN_PLACE, times, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return {times[0], times[1]};
}

/// One timed iteration of K variants (ours first, then raw MPI ones), each run `reps` times in
/// a row; the starting variant rotates every iteration so none always inherits another's cache
/// state or the skew the previous one left between ranks (each enabled variant goes first equally
/// often). Returns the slowest rank's seconds per
/// call of each variant, identical on every rank. Variants with `enabled[k]` false are skipped
/// (time 0).
template <size_t K, class Fns>
std::array<double, K> time_variants(size_t& first, int reps, const std::array<bool, K>& enabled, Fns&& run) {
  auto now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  std::array<size_t, K> order{};
  size_t m = 0;
  for (size_t k = 0; k < K; ++k)
    if (enabled[k]) order[m++] = k;
  std::array<double, K> t{};
  for (size_t j = 0; j < m; ++j) {
    const size_t k = order[(first + j) % m];
    const double t0 = now();
    for (int r = 0; r < reps; ++r) run(k);
    t[k] = (now() - t0) / reps;
  }
  first = m ? (first + 1) % m : 0;
  MPI_Allreduce(MPI_IN_PLACE, t.data(), int(K), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

/// Runs the registered benchmarks, reporting from rank 0 only.
inline void run_benchmarks_on_rank0(int rank) {
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    SilentReporter silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
}

}  // namespace quilt
