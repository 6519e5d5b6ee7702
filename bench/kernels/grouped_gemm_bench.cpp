// grouped_mm TFLOP/s against the two ways to do without it, timed in the same run, interleaved:
//   dense: one engine matmul (M_total, K) @ (K, N) of the same FLOPs (the ceiling: one big GEMM),
//   loop:  one engine matmul per expert over its rows (what a model without grouped_mm runs).
// Shapes are the expert matrices of Qwen3-30B-A3B (E=128, K=2048, N=768 gate/up, K=2048, N=1536
// gate and up side by side, and K=768, N=2048 down) and DeepSeek-V3 (E=256, K=7168, N=2048), with fewer experts than the models so
// that a case takes about a second on two cores (under 1 s for Qwen, ~2 s for DeepSeek at 256
// rows; the whole suite ~1 minute); rows per expert 64, 256, 1024, balanced
// or Zipf-skewed (expert e gets a share proportional to 1/(e+1)); weights stored (E, N, K) and
// read through a transposed view (stacked Linear weights, as models/moe keeps them: "nk") or
// stored (E, K, N) ("kn"); the baselines read the same storage. Counters: TFLOPs (grouped),
// dense_TFLOPs, loop_TFLOPs, vs_dense = grouped/dense, vs_loop = grouped/loop (best of the
// iterations of each), faults = page faults per timed grouped call. The same in bf16 (f32
// accumulate) for the model's nk layout: the engine's bf16 matmul is the dense and loop baseline
// there.
// Then moe_permute + moe_unpermute GB/s against memcpy's in the same run (vs_copy).
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/engine/bench_util.h"
#include "engine/engine.h"
#include "engine/ops/moe.h"

using namespace quilt;

namespace {

using Clock = std::chrono::steady_clock;

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

double seconds_of(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct ExpertShape {
  const char* name;
  int64_t k, n;
};
const ExpertShape kShapes[] = {
    {"qwen3_30b_a3b_up", 2048, 768},
    {"qwen3_30b_a3b_gate_up", 2048, 1536},  // gate and up of one expert side by side
    {"qwen3_30b_a3b_down", 768, 2048},
    {"deepseek_v3", 7168, 2048},
};
const int64_t kRowsPerExpert[] = {64, 256, 1024};

// Experts per case: about kFlopBudget per grouped call (~40 ms here), at least 4 experts (2 where
// one expert is already 3 GFLOP or more: Qwen's at 1024 rows, DeepSeek's at 256).
constexpr double kFlopBudget = 3e9;

int64_t experts_for(const ExpertShape& s, int64_t rows) {
  const double per_expert = 2.0 * double(s.k) * double(s.n) * double(rows);
  const int64_t floor = per_expert >= 3e9 ? 2 : 4;
  return std::clamp<int64_t>(int64_t(std::lround(kFlopBudget / per_expert)), floor, 64);
}

// FLOPs of one grouped call of a case.
double flops_of(const ExpertShape& s, int64_t rows) {
  return 2.0 * double(s.k) * double(s.n) * double(rows) * double(experts_for(s, rows));
}

// Rows per expert: all `rows`, or Zipf-like shares of experts * rows (largest first).
std::vector<int64_t> routing_counts(int64_t experts, int64_t rows, bool skewed) {
  std::vector<int64_t> c(size_t(experts), rows);
  if (!skewed) return c;
  const int64_t total = experts * rows;
  double h = 0;
  for (int64_t e = 0; e < experts; ++e) h += 1.0 / double(e + 1);
  int64_t used = 0;
  for (int64_t e = 0; e < experts; ++e) used += c[size_t(e)] = int64_t(double(total) / (h * double(e + 1)));
  c[0] += total - used;  // rounding leftovers to the busiest expert
  return c;
}

void BM_grouped_mm(benchmark::State& state, ExpertShape s, int64_t rows, bool skewed, bool nk, DType dt) {
  const int64_t experts = experts_for(s, rows);
  const std::vector<int64_t> counts = routing_counts(experts, rows, skewed);
  std::vector<int64_t> off(counts.size());
  std::partial_sum(counts.begin(), counts.end(), off.begin());
  const int64_t m = off.back();
  const Tensor offsets = from_vector(std::vector<double>(off.begin(), off.end()), {experts}, {.dtype = DType::i64});
  const Tensor x = randn({m, s.k}, RngKey(1, "x")).to(dt);
  const Tensor w = nk ? randn({experts, s.n, s.k}, RngKey(1, "w")).to(dt).transpose(1, 2)
                      : randn({experts, s.k, s.n}, RngKey(1, "w")).to(dt);
  const Tensor w_dense = w.select(0, 0);
  std::vector<Tensor> xs, ws;
  for (int64_t e = 0, start = 0; e < experts; start = off[size_t(e)], ++e) {
    xs.push_back(x.narrow(0, start, counts[size_t(e)]));
    ws.push_back(w.select(0, e));
  }
  auto grouped = [&] { benchmark::DoNotOptimize(grouped_mm(x, w, offsets).data_ptr()); };
  auto dense = [&] { benchmark::DoNotOptimize(matmul(x, w_dense).data_ptr()); };
  auto loop = [&] {
    for (size_t e = 0; e < xs.size(); ++e)
      if (xs[e].size(0) > 0) benchmark::DoNotOptimize(matmul(xs[e], ws[e]).data_ptr());
  };
  // Warm-up, until the steady state a training loop sees: outputs first touched, Eigen's blocking
  // computed, and the GEMM libraries' per-call packing buffers (oneDNN's are megabytes) settled in
  // malloc's heaps, which takes a few calls.
  for (int i = 0; i < 4; ++i) grouped(), dense(), loop();
  // Best of the iterations for each, interleaved: on a shared machine the quietest moment of
  // each is the fairest comparison (a neighbour's burst hurts the fork-join baselines most).
  double tg = 1e30, td = 1e30, tl = 1e30;
  long faults = 0, calls = 0;  // page faults in the timed grouped calls (0 in the steady state)
  for (auto _ : state) {
    const long f0 = minor_faults();
    const double g = seconds_of(grouped);
    faults += minor_faults() - f0, ++calls;
    td = std::min(td, seconds_of(dense));
    tl = std::min(tl, seconds_of(loop));
    tg = std::min(tg, g);
    state.SetIterationTime(g);
  }
  const double flops = 2.0 * double(m) * double(s.k) * double(s.n);
  state.counters["TFLOPs"] = flops / tg / 1e12;
  state.counters["dense_TFLOPs"] = flops / td / 1e12;
  state.counters["loop_TFLOPs"] = flops / tl / 1e12;
  state.counters["vs_dense"] = td / tg;
  state.counters["vs_loop"] = tl / tg;
  state.counters["faults"] = double(faults) / double(std::max<long>(calls, 1));
  state.counters["experts"] = double(experts);
  state.counters["max_rows"] = double(*std::max_element(counts.begin(), counts.end()));
  state.SetLabel(std::string(s.name) + (skewed ? " zipf" : " balanced") + (nk ? " w(E,N,K)^T" : " w(E,K,N)") + " " +
                 dtype_name(dt));
}

// ---- permute + combine bandwidth ----

// Copies `bytes` with the OpenMP threads each taking a contiguous slice.
void parallel_memcpy(char* dst, const char* src, size_t bytes) {
#pragma omp parallel
  {
    const size_t t = size_t(omp_get_thread_num()), n = size_t(omp_get_num_threads());
    const size_t b = bytes * t / n, e = bytes * (t + 1) / n;
    std::memcpy(dst + b, src + b, e - b);
  }
}

void BM_permute_unpermute(benchmark::State& state) {
  const int64_t tokens = state.range(0), k = 8, h = 2048, experts = 128;  // Qwen3-30B-A3B's router
  std::mt19937 rng(7);
  std::vector<int64_t> all(static_cast<size_t>(experts));
  std::iota(all.begin(), all.end(), 0);
  std::vector<double> idx;
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    idx.insert(idx.end(), all.begin(), all.begin() + k);
  }
  const MoeRouting r = moe_route(from_vector(idx, {tokens, k}, {.dtype = DType::i64}), experts);
  const Tensor x = randn({tokens, h}, RngKey(2, "x")), weights = rand({tokens, k}, RngKey(2, "w"));
  Tensor y = moe_permute(x, r.order, k);
  const size_t copy_bytes = y.nbytes();
  std::vector<char> a(copy_bytes, 1), b(copy_bytes);
  auto copy1 = [&] { std::memcpy(b.data(), a.data(), copy_bytes); benchmark::DoNotOptimize(b.data()); };
  auto copyn = [&] { parallel_memcpy(b.data(), a.data(), copy_bytes); benchmark::DoNotOptimize(b.data()); };
  auto permute = [&] { y = moe_permute(x, r.order, k); benchmark::DoNotOptimize(y.data_ptr()); };
  auto combine = [&] { benchmark::DoNotOptimize(moe_unpermute(y, r.order, weights).data_ptr()); };
  copy1(), copyn(), permute(), combine();
  double tp = 1e30, tu = 1e30, t1 = 1e30, tn = 1e30;  // best of the iterations, as above
  for (auto _ : state) {
    const double p = seconds_of(permute), u = seconds_of(combine);
    t1 = std::min(t1, seconds_of(copy1));
    tn = std::min(tn, seconds_of(copyn));
    tp = std::min(tp, p);
    tu = std::min(tu, u);
    state.SetIterationTime(p + u);
  }
  const double row = double(h) * double(x.element_size());
  const double tk = double(tokens * k), tt = double(tokens);
  const double perm_bytes = 2 * tk * row, comb_bytes = (tk + tt) * row;  // rows read + rows written
  const double copy_gbps = std::max(2.0 * double(copy_bytes) / t1, 2.0 * double(copy_bytes) / tn) / 1e9;
  state.counters["GBps"] = (perm_bytes + comb_bytes) / (tp + tu) / 1e9;
  state.counters["permute_GBps"] = perm_bytes / tp / 1e9;
  state.counters["combine_GBps"] = comb_bytes / tu / 1e9;
  state.counters["copy_GBps"] = copy_gbps;
  state.counters["memcpy1_GBps"] = 2.0 * double(copy_bytes) / t1 / 1e9;
  state.counters["vs_copy"] = state.counters["GBps"] / copy_gbps;
}

const bool kRegistered = [] {
  for (const ExpertShape& s : kShapes)
    for (int64_t rows : kRowsPerExpert) {
      // One DeepSeek expert at 1024 rows is 30 GFLOP (~0.4 s here per call, x3 baselines):
      // past this suite's time budget; the Qwen shapes cover 1024 rows per expert.
      if (s.k * s.n * rows > int64_t(8) << 30) continue;
      for (DType dt : {DType::f32, DType::bf16})
        for (bool nk : {true, false})
          for (bool skewed : {false, true}) {
            // bf16 (what mixed-precision MoE training multiplies): the model's layout only.
            if (dt == DType::bf16 && !nk) continue;
            const std::string name = std::string("BM_grouped_mm/") + s.name + (nk ? "/nk" : "/kn") +
                                     (dt == DType::bf16 ? "/bf16" : "") + "/rows:" + std::to_string(rows) +
                                     (skewed ? "/zipf" : "/balanced");
            benchmark::RegisterBenchmark(name.c_str(),
                                         [=](benchmark::State& st) { BM_grouped_mm(st, s, rows, skewed, nk, dt); })
                ->UseManualTime()
                ->Iterations(flops_of(s, rows) > 6e9 ? 2 : 3)  // the largest calls: 6.4 to 15 GFLOP
                ->Unit(benchmark::kMillisecond);
          }
    }
  benchmark::RegisterBenchmark("BM_permute_unpermute", BM_permute_unpermute)
      ->Arg(2048)
      ->UseManualTime()
      ->Iterations(5)
      ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
