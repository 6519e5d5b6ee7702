// Collectives bandwidth and latency under mpirun, reported like nccl-tests: for every op and size,
// the time per call (the slowest rank's), algbw = bytes / time and busbw = algbw * the op's bus
// factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast and
// send/recv 1), as counters algbw_GBps and busbw_GBps. "bytes" is the whole buffer, as in
// nccl-tests (all_gather: the gathered output).
//
// With the MPI backend every iteration also times, on the same buffers and in rotating order,
// the raw MPI call a user would make instead (MPI_Allreduce, MPI_Allgather,
// MPI_Reduce_scatter_block, MPI_Alltoall, MPI_Bcast, MPI_Sendrecv) and, where ours reaches MPI
// differently, that form too: all_reduce also times MPI_Iallreduce + MPI_Wait, all_to_all also
// MPI_Alltoallv (what ours calls, so that ranks with unequal splits still match). Counters:
//   us, mpi_us        median microseconds per call, ours and the raw call a user would make
//   vs_mpi            mpi_us / us (1 = MPI's speed; the ratio column)
//   mpi_iallreduce_us / mpi_alltoallv_us   the second raw form, median per call
//   mpi_busbw_GBps    raw MPI's busbw
// Small sizes run `reps` calls per timed iteration (16 up to 64 KiB, else 1; --reps=N sets it)
// so a sub-microsecond difference is not lost in the clock and the per-iteration sync, and a
// fixed number of timed iterations there (--iters=N, default 1000; 0 lets Google Benchmark pick).
// Medians, not means: the machine may be shared, and a descheduled rank costs one iteration.
// Rank 0 reports; the others run the same benchmarks silently. The slowest rank's time drives
// Google Benchmark's iteration count, so every rank runs the same number of iterations.
//
//   mpirun -np 4 collectives_bench [--min_bytes=8] [--max_bytes=268435456] [--step=4] [--reps=N] [--iters=N]
//          [--dtype=f32|bf16|...] [--benchmark_filter=all_reduce] [--benchmark_format=json]
//   mpirun -np 2 collectives_bench --max_bytes=65536 --step=4   # the small-message table
#include <benchmark/benchmark.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/collectives/mpi_bench.h"
#include "collectives/launch.h"
#include "engine/engine.h"

using namespace quilt;

namespace {

enum class Op { all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send_recv };

const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::all_gather: return "all_gather";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_to_all: return "all_to_all";
    case Op::broadcast: return "broadcast";
    case Op::send_recv: return "send_recv";
  }
  return "?";
}

// nccl-tests' bus bandwidth factors: what each rank's link carries relative to algbw.
double bus_factor(Op op, int n) {
  switch (op) {
    case Op::all_reduce: return 2.0 * (n - 1) / n;
    case Op::all_gather:
    case Op::reduce_scatter:
    case Op::all_to_all: return double(n - 1) / n;
    case Op::broadcast:
    case Op::send_recv: return 1.0;
  }
  return 1.0;
}

struct Config {
  DType dtype = DType::f32;
  bool raw_mpi = false;  // the world is the MPI backend and the dtype has an MPI counterpart
  int reps = 0;          // calls per timed iteration; 0: 16 up to 64 KiB, else 1
  int iters = 1000;      // timed iterations up to 64 KiB (0: Google Benchmark chooses)
};
Config g_cfg;

MPI_Datatype raw_type(DType dt) {
  switch (dt) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}

// Buffers of one benchmark: `count` elements in total, divisible by the world size.
struct Buffers {
  Tensor in, out;
  int64_t count = 0;
  std::vector<int> counts, displs;  // equal parts, for the raw MPI_Alltoallv
};

Buffers make_buffers(Op op, int64_t count, int n, Device dev) {
  Buffers b;
  b.count = count;
  const TensorOptions o{.dtype = g_cfg.dtype, .device = dev};
  const int64_t part = count / n;
  for (int i = 0; i < n; ++i) {
    b.counts.push_back(int(part));
    b.displs.push_back(int(part) * i);
  }
  switch (op) {
    case Op::all_reduce:
    case Op::broadcast: b.in = b.out = full({count}, 1.0, o); break;
    case Op::all_gather: b.in = full({part}, 1.0, o); b.out = full({count}, 0.0, o); break;
    case Op::reduce_scatter: b.in = full({count}, 1.0, o); b.out = full({part}, 0.0, o); break;
    case Op::all_to_all:
    case Op::send_recv: b.in = full({count}, 1.0, o); b.out = full({count}, 0.0, o); break;
  }
  return b;
}

void run_quilt(Communicator& c, Op op, Buffers& b) {
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  switch (op) {
    case Op::all_reduce: c.all_reduce(b.out, ReduceOp::sum); break;
    case Op::all_gather: c.all_gather(b.out, b.in); break;
    case Op::reduce_scatter: c.reduce_scatter(b.out, b.in, ReduceOp::sum); break;
    case Op::all_to_all: c.all_to_all_single(b.out, b.in); break;
    case Op::broadcast: c.broadcast(b.out, 0); break;
    case Op::send_recv: c.batch_p2p({P2POp::send(b.in, next), P2POp::recv(b.out, prev)}); break;
  }
  if (c.device().is_cuda()) synchronize(current_stream(c.device()));
}

void run_raw(Op op, Buffers& b, int rank, int n) {
  const MPI_Datatype t = raw_type(g_cfg.dtype);
  const int count = int(b.count), part = int(b.count / n);
  void* in = b.in.data_ptr();
  void* out = b.out.data_ptr();
  switch (op) {
    case Op::all_reduce: MPI_Allreduce(MPI_IN_PLACE, out, count, t, MPI_SUM, MPI_COMM_WORLD); break;
    case Op::all_gather: MPI_Allgather(in, part, t, out, part, t, MPI_COMM_WORLD); break;
    case Op::reduce_scatter: MPI_Reduce_scatter_block(in, out, part, t, MPI_SUM, MPI_COMM_WORLD); break;
    case Op::all_to_all: MPI_Alltoall(in, part, t, out, part, t, MPI_COMM_WORLD); break;
    case Op::broadcast: MPI_Bcast(out, count, t, 0, MPI_COMM_WORLD); break;
    case Op::send_recv:
      MPI_Sendrecv(in, count, t, (rank + 1) % n, 0, out, count, t, (rank + n - 1) % n, 0, MPI_COMM_WORLD,
                   MPI_STATUS_IGNORE);
      break;
  }
}

// The second raw form: how ours reaches MPI where that differs from the call a user would make.
const char* raw2_counter(Op op) {
  switch (op) {
    case Op::all_reduce: return "mpi_iallreduce_us";
    case Op::all_to_all: return "mpi_alltoallv_us";
    default: return nullptr;
  }
}

void run_raw2(Op op, Buffers& b) {
  const MPI_Datatype t = raw_type(g_cfg.dtype);
  const int count = int(b.count);
  void* in = b.in.data_ptr();
  void* out = b.out.data_ptr();
  switch (op) {
    case Op::all_reduce: {
      MPI_Request r = MPI_REQUEST_NULL;
      MPI_Iallreduce(MPI_IN_PLACE, out, count, t, MPI_SUM, MPI_COMM_WORLD, &r);
      MPI_Wait(&r, MPI_STATUS_IGNORE);
      break;
    }
    case Op::all_to_all: {
      MPI_Alltoallv(in, b.counts.data(), b.displs.data(), t, out, b.counts.data(), b.displs.data(), t, MPI_COMM_WORLD);
      break;
    }
    default: break;
  }
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

void bench(benchmark::State& state, Op op) {
  Communicator& c = world();
  const int n = c.size();
  const size_t es = dtype_size(g_cfg.dtype);
  // Gathers, scatters and all-to-all split the buffer into n equal parts.
  const bool split = op == Op::all_gather || op == Op::reduce_scatter || op == Op::all_to_all;
  const int64_t elems = std::max<int64_t>(1, state.range(0) / int64_t(es));
  const int64_t count = split ? std::max<int64_t>(n, elems / n * n) : elems;
  const double bytes = double(count) * double(es);
  Buffers b = make_buffers(op, count, n, c.device());
  const bool raw = g_cfg.raw_mpi && c.device().is_cpu();
  const bool raw2 = raw && raw2_counter(op) != nullptr;
  const int reps = g_cfg.reps > 0 ? g_cfg.reps : (bytes <= 65536 ? 16 : 1);
  for (int i = 0; i < 20; ++i) {  // warm-up: first-touch pages, connection set-up, caches
    run_quilt(c, op, b);
    if (raw) run_raw(op, b, c.rank(), n);
    if (raw2) run_raw2(op, b);
  }
  std::array<std::vector<double>, 3> times;
  size_t first = 0;
  for (auto _ : state) {
    const auto t = time_variants<3>(first, reps, {true, raw, raw2}, [&](size_t k) {
      if (k == 0) run_quilt(c, op, b);
      else if (k == 1) run_raw(op, b, c.rank(), n);
      else run_raw2(op, b);
    });
    state.SetIterationTime(t[0] * reps);
    for (size_t k = 0; k < 3; ++k) times[k].push_back(t[k]);
  }
  const double ours = median(times[0]);
  const double algbw = bytes / ours / 1e9;
  state.counters["bytes"] = bytes;
  state.counters["us"] = ours * 1e6;
  state.counters["algbw_GBps"] = algbw;
  state.counters["busbw_GBps"] = algbw * bus_factor(op, n);
  if (raw) {
    const double mpi = median(times[1]);
    state.counters["mpi_us"] = mpi * 1e6;
    state.counters["mpi_busbw_GBps"] = bytes / mpi / 1e9 * bus_factor(op, n);
    state.counters["vs_mpi"] = mpi / ours;
  }
  if (raw2) state.counters[raw2_counter(op)] = median(times[2]) * 1e6;
}


// Removes "--name=value" from argv and returns the value (or `fallback`).
std::string take_flag(int& argc, char** argv, const std::string& name, const std::string& fallback) {
  std::string value = fallback;
  const std::string prefix = "--" + name + "=";
  int w = 1;
  for (int r = 1; r < argc; ++r) {
    if (std::strncmp(argv[r], prefix.c_str(), prefix.size()) == 0) value = argv[r] + prefix.size();
    else argv[w++] = argv[r];
  }
  argc = w;
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  init_from_launcher();
  Communicator& c = world();
  const int64_t min_bytes = std::atoll(take_flag(argc, argv, "min_bytes", "8").c_str());
  const int64_t max_bytes = std::atoll(take_flag(argc, argv, "max_bytes", "268435456").c_str());
  const int64_t step = std::max<int64_t>(2, std::atoll(take_flag(argc, argv, "step", "4").c_str()));
  const std::string dtype = take_flag(argc, argv, "dtype", "f32");
  g_cfg.reps = std::atoi(take_flag(argc, argv, "reps", "0").c_str());
  g_cfg.iters = std::atoi(take_flag(argc, argv, "iters", "1000").c_str());
  bool known = false;
  for (int d = 0; d < kNumDTypes; ++d)
    if (dtype == dtype_name(DType(d))) {
      g_cfg.dtype = DType(d);
      known = true;
    }
  if (!known) {
    log_line("unknown --dtype=", dtype);
    return 2;
  }
  g_cfg.raw_mpi = c.backend() == "mpi" && raw_type(g_cfg.dtype) != MPI_DATATYPE_NULL;
  if (c.rank() != 0) {  // only rank 0 writes --benchmark_out
    take_flag(argc, argv, "benchmark_out", "");
    take_flag(argc, argv, "benchmark_out_format", "");
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  std::vector<int64_t> sizes;
  for (int64_t s = min_bytes; s <= max_bytes; s *= step) sizes.push_back(s);
  if (sizes.empty() || sizes.back() != max_bytes) sizes.push_back(max_bytes);
  for (Op op : {Op::all_reduce, Op::all_gather, Op::reduce_scatter, Op::all_to_all, Op::broadcast, Op::send_recv}) {
    if (op == Op::send_recv && c.size() < 2) continue;
    for (int64_t s : sizes) {
      auto* b = benchmark::RegisterBenchmark(op_name(op), [op](benchmark::State& st) { bench(st, op); });
      b->Arg(s)->ArgName("bytes")->UseManualTime()->Unit(benchmark::kMicrosecond);
      // A fixed count for small sizes: one descheduled first iteration cannot cut the run short.
      if (s <= 65536 && g_cfg.iters > 0) b->Iterations(g_cfg.iters);
    }
  }
  log_line("collectives bench: ", c.size(), " ranks, backend ", c.backend(), ", dtype ", dtype_name(g_cfg.dtype));
  run_benchmarks_on_rank0(c.rank());
  benchmark::Shutdown();
  finalize();
  return 0;
}
