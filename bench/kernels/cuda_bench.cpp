// CUDA kernel benchmarks: GEMM (bf16, f32), copy and cast bandwidth, elementwise add, random
// fill, softmax, cross entropy and reductions, each reporting TFLOPs or GBps and pct_peak
// against the H200 ceilings this project measures against (bf16 dense GEMM ~790 TFLOP/s,
// f32 GEMM without TF32 ~67 TFLOP/s, device copy ~4.3 TB/s read + write). Kernels are called
// directly on device pointers (no Tensor bookkeeping inside the timed loop); each timed
// iteration enqueues `reps` launches and waits once, so launch latency is amortised.
// Without a CUDA device it registers nothing and says so. After the runs it prints one table.
//
//   ./cuda_bench                     # all, then the table
//   ./cuda_bench --benchmark_filter=gemm --benchmark_min_time=0.2
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "bench/kernels/cuda_bench.h"
#include "kernels/cuda/kernels.h"

using namespace quilt;
using namespace quilt::cuda_bench;

namespace {

kernels::Loop<2> flat2(void* out, void* in, int64_t n) {
  const int64_t shape[1] = {n}, st[1] = {1};
  const int64_t* strides[2] = {st, st};
  void* data[2] = {out, in};
  return kernels::make_loop<2>(1, shape, strides, data);
}

void bm_gemm(benchmark::State& state, DType dt, int64_t n) {
  Tensor a = dev_randn({n, n}, dt, "a"), b = dev_randn({n, n}, dt, "b");
  Tensor c = empty({n, n}, {.dtype = dt, .device = kGpu});
  kernels::GemmArgs g;
  g.m = g.n = g.k = n;
  g.a = a.data_ptr(); g.lda = n;
  g.b = b.data_ptr(); g.ldb = n;
  g.c = c.data_ptr(); g.ldc = n;
  const double flops = 2.0 * double(n) * double(n) * double(n);
  timed(state, n >= 8192 ? 3 : 10, flops, true, dt == DType::bf16 ? kPeakBf16Tflops : kPeakF32Tflops,
        [&] { kernels::cuda::gemm(dt, g, stream()); });
}

void bm_copy(benchmark::State& state, DType out_dt, DType in_dt, int64_t n) {
  Tensor x = dev_randn({n}, in_dt, "x");
  Tensor y = empty({n}, {.dtype = out_dt, .device = kGpu});
  const auto loop = flat2(y.data_ptr(), x.data_ptr(), n);
  const double bytes = double(n) * double(dtype_size(in_dt) + dtype_size(out_dt));
  timed(state, 10, bytes, false, kPeakGBps, [&] { kernels::cuda::copy(out_dt, in_dt, loop, stream()); });
}

void bm_add(benchmark::State& state, DType dt, int64_t n) {
  Tensor x = dev_randn({n}, dt, "x"), y = dev_randn({n}, dt, "y");
  Tensor z = empty({n}, {.dtype = dt, .device = kGpu});
  const int64_t shape[1] = {n}, st[1] = {1};
  const int64_t* strides[3] = {st, st, st};
  void* data[3] = {z.data_ptr(), x.data_ptr(), y.data_ptr()};
  const auto loop = kernels::make_loop<3>(1, shape, strides, data);
  timed(state, 10, 3.0 * double(n) * double(dtype_size(dt)), false, kPeakGBps,
        [&] { kernels::cuda::binary(kernels::BinaryOp::add, dt, loop, stream()); });
}

void bm_randn(benchmark::State& state, DType dt, int64_t n) {
  Tensor y = empty({n}, {.dtype = dt, .device = kGpu});
  kernels::RandomArgs args;
  args.ndim = 1;
  args.shape[0] = n;
  args.global_strides[0] = 1;
  args.seed = 1;
  args.key = 2;
  timed(state, 10, double(n) * double(dtype_size(dt)), false, kPeakGBps,
        [&] { kernels::cuda::random_normal(dt, y.data_ptr(), args, stream()); });
}

void bm_softmax(benchmark::State& state, DType dt, int64_t rows, int64_t cols) {
  Tensor x = dev_randn({rows, cols}, dt, "x");
  Tensor y = empty({rows, cols}, {.dtype = dt, .device = kGpu});
  timed(state, 10, 2.0 * double(rows * cols) * double(dtype_size(dt)), false, kPeakGBps,
        [&] { kernels::cuda::softmax_forward(dt, y.data_ptr(), x.data_ptr(), rows, cols, false, stream()); });
}

void bm_cross_entropy(benchmark::State& state, DType dt, int64_t rows, int64_t cols) {
  Tensor x = dev_randn({rows, cols}, dt, "x");
  Tensor t = randint(0, cols, {rows}, RngKey(1, "t")).to(kGpu);
  Tensor loss = empty({rows}, {.device = kGpu});
  timed(state, 10, double(rows * cols) * double(dtype_size(dt)), false, kPeakGBps, [&] {
    kernels::cuda::cross_entropy_forward(dt, loss.data<float>(), x.data_ptr(), t.data<int64_t>(), rows, cols, -100,
                                         stream());
  });
}

// Sum over the last dim of (rows, cols): rows == 1 is a full reduction (two passes).
void bm_sum(benchmark::State& state, DType dt, int64_t rows, int64_t cols) {
  Tensor x = dev_randn({rows, cols}, dt, "x");
  Tensor y = empty({rows}, {.dtype = dt, .device = kGpu});
  kernels::ReduceLoop l;
  if (rows > 1) {
    l.out_ndim = 1;
    l.out_shape[0] = rows;
    l.out_strides[0] = 1;
    l.in_out_strides[0] = cols;
  }
  l.red_ndim = 1;
  l.red_shape[0] = cols;
  l.red_strides[0] = 1;
  l.in = x.data_ptr();
  l.out = y.data_ptr();
  timed(state, 10, double(rows * cols) * double(dtype_size(dt)), false, kPeakGBps,
        [&] { kernels::cuda::reduce(kernels::ReduceOp::sum, dt, dt, l, stream()); });
}

void register_core() {
  for (int64_t n : {4096, 8192}) {
    reg("gemm_bf16/" + shape_of({n, n, n}), [n](benchmark::State& s) { bm_gemm(s, DType::bf16, n); });
    reg("gemm_f32/" + shape_of({n, n, n}), [n](benchmark::State& s) { bm_gemm(s, DType::f32, n); });
  }
  const int64_t big = int64_t(1) << 28;  // 1 GiB of f32
  reg("copy_f32/" + shape_of({big}), [big](benchmark::State& s) { bm_copy(s, DType::f32, DType::f32, big); });
  reg("cast_f32_to_bf16/" + shape_of({big}), [big](benchmark::State& s) { bm_copy(s, DType::bf16, DType::f32, big); });
  reg("cast_bf16_to_f32/" + shape_of({big}), [big](benchmark::State& s) { bm_copy(s, DType::f32, DType::bf16, big); });
  reg("add_f32/" + shape_of({big}), [big](benchmark::State& s) { bm_add(s, DType::f32, big); });
  reg("add_bf16/" + shape_of({big}), [big](benchmark::State& s) { bm_add(s, DType::bf16, big); });
  reg("randn_f32/" + shape_of({big}), [big](benchmark::State& s) { bm_randn(s, DType::f32, big); });
  reg("softmax_bf16/" + shape_of({16384, 4096}), [](benchmark::State& s) { bm_softmax(s, DType::bf16, 16384, 4096); });
  reg("softmax_f32/" + shape_of({65536, 512}), [](benchmark::State& s) { bm_softmax(s, DType::f32, 65536, 512); });
  reg("cross_entropy_bf16/" + shape_of({8192, 32768}),
      [](benchmark::State& s) { bm_cross_entropy(s, DType::bf16, 8192, 32768); });
  reg("sum_f32/" + shape_of({big}), [big](benchmark::State& s) { bm_sum(s, DType::f32, 1, big); });
  reg("row_sum_f32/" + shape_of({65536, 4096}), [](benchmark::State& s) { bm_sum(s, DType::f32, 65536, 4096); });
}

// Collects every run and prints one table at the end: kernel, shape, time, rate, % of ceiling.
class TableReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) rows_.push_back(r);
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\n%-20s %-16s %12s %14s %10s\n", "kernel", "shape", "time", "rate", "% of peak");
    for (const Run& r : rows_) {
      const std::string name = r.benchmark_name();
      const size_t slash = name.find('/');
      const std::string kernel = name.substr(0, slash);
      std::string shape = slash == std::string::npos ? "" : name.substr(slash + 1);
      const std::string suffix = "/manual_time";
      if (shape.size() >= suffix.size() && shape.compare(shape.size() - suffix.size(), suffix.size(), suffix) == 0)
        shape.resize(shape.size() - suffix.size());
      if (r.error_occurred) {
        std::printf("%-20s %-16s %12s %14s %10s  (%s)\n", kernel.c_str(), shape.c_str(), "-", "-", "-",
                    r.error_message.c_str());
        continue;
      }
      const double us = r.GetAdjustedRealTime() * 1e6 / benchmark::GetTimeUnitMultiplier(r.time_unit);
      char rate[32] = "-", pct[16] = "-";
      auto tf = r.counters.find("TFLOPs"), gb = r.counters.find("GBps"), pk = r.counters.find("pct_peak");
      if (tf != r.counters.end()) std::snprintf(rate, sizeof(rate), "%.1f TFLOP/s", double(tf->second));
      if (gb != r.counters.end()) std::snprintf(rate, sizeof(rate), "%.0f GB/s", double(gb->second));
      if (pk != r.counters.end()) std::snprintf(pct, sizeof(pct), "%.1f%%", double(pk->second));
      std::printf("%-20s %-16s %9.1f us %14s %10s\n", kernel.c_str(), shape.c_str(), us, rate, pct);
    }
    std::fflush(stdout);
  }

 private:
  std::vector<Run> rows_;
};

const Registrar core(register_core);

}  // namespace

namespace quilt::cuda_bench {
std::vector<void (*)()>& registry() {
  static std::vector<void (*)()> fns;
  return fns;
}
}  // namespace quilt::cuda_bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (!cuda::is_available()) {
    std::printf("cuda_bench: skipped: no CUDA device (%s)\n", cuda::unavailable_reason().c_str());
    return 0;
  }
  for (void (*fn)() : registry()) fn();
  TableReporter table;
  benchmark::RunSpecifiedBenchmarks(&table);
  benchmark::Shutdown();
  return 0;
}
