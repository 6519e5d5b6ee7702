// The GEMM table: every GEMM library this process can use, side by side in one run, at the
// shapes training runs (square 512/1024/2048 and tokens x hidden: 8192x512x512, 8192x512x1376,
// 8192x1376x512 in all four transpose modes), in f32 and in bf16 (f32 accumulate). Each row
// calls the engine's GEMM kernel with one library forced; the "default" rows call it with none
// forced, so they run what training runs: the library chosen for the row's shape class (f32),
// oneDNN's native kernel (bf16 on CPUs with bf16 instructions), or the per-mode choice. After
// the runs a summary prints, per shape, the default's GFLOP/s against the best library's.
//
//   build/bin/matmul_bench                       # the whole table (about a minute)
//   build/bin/matmul_bench --benchmark_filter=f32/2048
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench/engine/bench_util.h"
#include "engine/engine.h"
#include "kernels/cpu/gemm_libs.h"
#include "kernels/cpu/matmul.h"

using namespace quilt;

namespace {

struct Case {
  int64_t m, n, k;
  bool ta, tb;
  std::string name() const {
    return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + "/" + (ta ? "T" : "N") +
           (tb ? "T" : "N");
  }
};

std::vector<Case> cases() {
  std::vector<Case> s;
  for (int64_t n : {512, 1024, 2048}) s.push_back({n, n, n, false, false});
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{8192, 512, 512}, {8192, 512, 1376}, {8192, 1376, 512}})
    for (int t = 0; t < 4; ++t) s.push_back({m, n, k, bool(t & 2), bool(t & 1)});
  return s;
}

std::string g_default[4];  // the library chosen for this machine, per transpose mode (2·ta + tb)
std::map<std::string, int> g_mode;  // row -> its transpose mode
std::map<std::string, std::map<std::string, double>> g_rates;  // "dtype/shape" -> lib -> GFLOP/s
std::map<std::string, std::string> g_chosen;  // "f32/shape" -> the library the default ran on

double flops(const Case& s) { return 2.0 * double(s.m) * double(s.n) * double(s.k); }

// One library, called through the engine's GEMM kernel on preallocated operands; "default" is
// the engine's own choice (per shape class for large f32 GEMMs, measured on the warm-up call
// unless the cache already has the class).
void run_library(benchmark::State& state, const std::string& lib, DType dt, Case s) {
  if (lib == "default") kernels::cpu::gemm_libs::set_auto();
  else kernels::cpu::set_gemm_backend(lib);
  Tensor a = randn(s.ta ? Shape{s.k, s.m} : Shape{s.m, s.k}, RngKey(1, "a")).to(dt);
  Tensor b = randn(s.tb ? Shape{s.n, s.k} : Shape{s.k, s.n}, RngKey(1, "b")).to(dt);
  Tensor c = empty({s.m, s.n}, {.dtype = dt});
  kernels::GemmArgs g{.m = s.m, .n = s.n, .k = s.k, .trans_a = s.ta, .trans_b = s.tb, .a = a.data_ptr(),
             .lda = s.ta ? s.m : s.k, .b = b.data_ptr(), .ldb = s.tb ? s.k : s.n, .c = c.data_ptr(), .ldc = s.n};
  kernels::cpu::gemm(dt, g);  // warm
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    kernels::cpu::gemm(dt, g);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bench::set_flops(state, flops(s));
  if (lib == "default" && dt == DType::f32) {
    const std::string chosen =
        kernels::cpu::gemm_libs::lib_name(kernels::cpu::gemm_libs::active_for(
            g, static_cast<const float*>(a.data_ptr()), static_cast<const float*>(b.data_ptr())));
    g_chosen[std::string(dtype_name(dt)) + "/" + s.name()] = chosen;
    state.SetLabel("default = " + chosen);
  } else {
    state.SetLabel(lib);
  }
  g_rates[std::string(dtype_name(dt)) + "/" + s.name()][lib] = flops(s) * double(state.iterations()) / secs / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  for (int mode = 0; mode < 4; ++mode)
    g_default[mode] = kernels::cpu::gemm_libs::lib_name(kernels::cpu::gemm_libs::active(mode & 2, mode & 1));
  std::printf("GEMM libraries present: ");
  for (const auto& l : kernels::cpu::gemm_backends()) std::printf("%s ", l.c_str());
  std::printf("\ndefault: %s (%s)\n", kernels::cpu::gemm_backend().c_str(), kernels::cpu::gemm_backend_reason().c_str());
  for (DType dt : {DType::f32, DType::bf16})
    for (const Case& s : cases()) {
      const std::string row = std::string(dtype_name(dt)) + "/" + s.name();
      g_mode[row] = 2 * int(s.ta) + int(s.tb);
      std::vector<std::string> columns = kernels::cpu::gemm_backends();
      columns.push_back("default");
      for (const std::string& lib : columns)
        benchmark::RegisterBenchmark(("gemm/" + row + "/" + lib).c_str(),
                                     [=](benchmark::State& st) { run_library(st, lib, dt, s); })
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->MinTime(0.2);
    }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  // The summary: per shape, every library's GFLOP/s, the best, and the default against it.
  std::printf("\n%-26s", "dtype/shape (m x n x k)");
  for (const auto& l : kernels::cpu::gemm_backends()) std::printf(" %9s", l.c_str());
  std::printf("   best      default/best\n");
  double worst = 1e30;
  for (const auto& [row, rates] : g_rates) {
    std::printf("%-26s", row.c_str());
    std::string best;
    for (const auto& l : kernels::cpu::gemm_backends()) {
      auto it = rates.find(l);
      if (it == rates.end()) { std::printf(" %9s", "-"); continue; }
      std::printf(" %9.1f", it->second);
      if (best.empty() || it->second > rates.at(best)) best = l;
    }
    auto d = rates.find("default");
    if (d == rates.end()) { std::printf("\n"); continue; }
    const double ratio = d->second / rates.at(best);
    worst = std::min(worst, ratio);
    auto chosen = g_chosen.find(row);
    std::printf("   %-9s %5.2f  (%s)\n", best.c_str(), ratio,
                chosen != g_chosen.end() ? chosen->second.c_str()
                : row.starts_with("bf16") && kernels::cpu::gemm_libs::bf16_native() ? "onednn bf16"
                                                                                    : g_default[g_mode[row]].c_str());
  }
  if (worst < 1e30) std::printf("default / best library, worst shape: %.2f\n", worst);
  return 0;
}
