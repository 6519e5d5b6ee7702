// Expert-parallel token dispatch under mpirun: the all-to-all-v of token rows that an MoE
// layer does twice per forward (dispatch, combine), against raw MPI_Alltoallv in the same
// run: "comm" is the communicator's all_to_all_single into the same output buffer MPI writes
// (the transport alone), "op" is all_to_all_rows, the differentiable op the experts' hooks
// call, which also allocates its output each call (fresh pages at large sizes, until host
// buffers are cached). Rows are (hidden) f32; each rank sends rows to every rank with balanced or
// skewed (rank r sends (1 + (r + j) % n) parts to rank j) counts, as routing does. Reported
// like nccl-tests: bytes = the rows this rank sends, busbw = algbw * (n - 1) / n, counters
// busbw_GBps, mpi_busbw_GBps and vs_mpi (raw time / ours). The slowest rank's time counts.
//
//   mpirun -np 4 ep_dispatch_bench [--hidden=2048] [--benchmark_filter=skewed]
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "bench/collectives/mpi_bench.h"
#include "collectives/launch.h"
#include "engine/engine.h"
#include "parallel/expert_parallel.h"

using namespace quilt;

namespace {

int64_t g_hidden = 2048;

// Rows this rank sends to each rank and receives from each, for about `bytes` sent in all.
void splits_for(int64_t bytes, bool skewed, int r, int n, std::vector<int64_t>& in, std::vector<int64_t>& out) {
  const int64_t rows = std::max<int64_t>(n, bytes / int64_t(4 * g_hidden));
  auto parts = [&](int src, int dst) { return skewed ? 1 + (src + dst) % n : 1; };
  auto share = [&](int src, int dst) {
    int64_t total = 0;
    for (int j = 0; j < n; ++j) total += parts(src, j);
    return rows * parts(src, dst) / total;
  };
  in.assign(size_t(n), 0);
  out.assign(size_t(n), 0);
  for (int j = 0; j < n; ++j) {
    in[size_t(j)] = share(r, j);
    out[size_t(j)] = share(j, r);
  }
}

void bench(benchmark::State& state, bool skewed, bool op) {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  std::vector<int64_t> in, out;
  splits_for(state.range(0), skewed, r, n, in, out);
  const int64_t send_rows = std::accumulate(in.begin(), in.end(), int64_t{0});
  const int64_t recv_rows = std::accumulate(out.begin(), out.end(), int64_t{0});
  Tensor x = randn({send_rows, g_hidden}, RngKey(uint64_t(r), "rows"));
  Tensor raw_out = Tensor::empty({recv_rows, g_hidden});
  const size_t ranks = static_cast<size_t>(n);
  std::vector<int> sc(ranks), sd(ranks), rc(ranks), rd(ranks);
  for (int j = 0, so = 0, ro = 0; j < n; ++j) {
    sc[size_t(j)] = int(in[size_t(j)] * g_hidden);
    rc[size_t(j)] = int(out[size_t(j)] * g_hidden);
    sd[size_t(j)] = so;
    rd[size_t(j)] = ro;
    so += sc[size_t(j)];
    ro += rc[size_t(j)];
  }
  const std::shared_ptr<Communicator> comm = c.shared_from_this();
  NoGradGuard ng;
  Tensor ours_out = Tensor::empty({recv_rows, g_hidden});
  auto ours = [&] {
    if (op) benchmark::DoNotOptimize(all_to_all_rows(x, comm, in, out));
    else comm->all_to_all_single(ours_out, x, out, in);
  };
  auto raw = [&] {
    MPI_Alltoallv(x.data_ptr(), sc.data(), sd.data(), MPI_FLOAT, raw_out.data_ptr(), rc.data(), rd.data(), MPI_FLOAT,
                  MPI_COMM_WORLD);
  };
  ours();
  raw();
  double ours_total = 0, raw_total = 0;
  bool raw_first = false;
  for (auto _ : state) {
    const auto [t_ours, t_raw] = time_against_raw(raw_first, true, ours, raw);
    state.SetIterationTime(t_ours);
    ours_total += t_ours;
    raw_total += t_raw;
  }
  const double bytes = double(send_rows * g_hidden * 4), iters = double(state.iterations());
  const double bus = double(n - 1) / double(n);
  state.counters["bytes"] = bytes;
  state.counters["busbw_GBps"] = bytes * iters / ours_total / 1e9 * bus;
  state.counters["mpi_busbw_GBps"] = bytes * iters / raw_total / 1e9 * bus;
  state.counters["vs_mpi"] = raw_total / ours_total;
}


}  // namespace

int main(int argc, char** argv) {
  init_from_launcher();
  Communicator& c = world();
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--hidden=", 9) == 0) {
      g_hidden = std::atoll(argv[i] + 9);
      for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      break;
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  for (bool op : {false, true})
    for (bool skewed : {false, true}) {
      const std::string name = std::string("ep_dispatch/") + (op ? "op/" : "comm/") + (skewed ? "skewed" : "balanced");
      auto* b = benchmark::RegisterBenchmark(name.c_str(), [skewed, op](benchmark::State& s) { bench(s, skewed, op); });
      for (int64_t s = int64_t(1) << 16; s <= (int64_t(1) << 26); s *= 4) b->Arg(s);
      b->ArgName("bytes")->UseManualTime()->Unit(benchmark::kMicrosecond);
    }
  log_line("ep dispatch bench: ", c.size(), " ranks, backend ", c.backend(), ", hidden ", g_hidden, ", f32 rows");
  run_benchmarks_on_rank0(c.rank());
  benchmark::Shutdown();
  finalize();
  return 0;
}
