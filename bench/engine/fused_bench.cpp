// Fused memory-bound kernels of a training step, forward and backward side by side (RMSNorm,
// residual + RMSNorm, SwiGLU, RoPE, cross entropy from logits, multi-tensor AdamW), each in GB/s
// of the bytes it must move (reads + writes, counted per kernel below) and as a ratio to a copy
// of the same byte count on the same threads in the same run ("x_copy"). Sizes: the 12M Llama's
// training shapes (2048 tokens x hidden 512, a few MiB: cache-resident on a 32 MiB L3) and
// 8x that in tokens and 2x in width (tens of MiB per operand: DRAM).
//
//   OMP_NUM_THREADS=2 build/bench/fused_bench
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <vector>

#include "bench/engine/bench_util.h"
#include "engine/engine.h"
#include "kernels/cpu/nn.h"
#include "kernels/cpu/optim.h"

using namespace quilt;
namespace kc = quilt::kernels::cpu;

namespace {

// Copy of bytes/2 into another bytes/2 (so `bytes` moved), split over the OpenMP threads the
// kernels use: the bandwidth a memory-bound kernel of that traffic can hope for.
void parallel_copy(char* dst, const char* src, size_t n) {
  const int threads = omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < threads; ++t) {
    const size_t b = n * size_t(t) / size_t(threads), e = n * size_t(t + 1) / size_t(threads);
    std::memcpy(dst + b, src + b, e - b);
  }
}

// Median GB/s of a parallel copy moving `bytes` (read + write), measured now.
double copy_gbps(double bytes) {
  const size_t n = size_t(bytes / 2);
  std::vector<char> a(n, 1), b(n, 0);
  std::vector<double> s;
  for (int i = 0; i < 13; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    parallel_copy(b.data(), a.data(), n);
    benchmark::DoNotOptimize(b.data());
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 3) s.push_back(dt);
  }
  std::sort(s.begin(), s.end());
  return bytes / s[s.size() / 2] / 1e9;
}

// GB/s counter plus the ratio to a copy of the same bytes (both rates per iteration).
void report(benchmark::State& state, double bytes, double copy) {
  bench::set_bandwidth(state, bytes);
  state.counters["copy_GBps"] = copy;
  state.counters["x_copy"] = benchmark::Counter(bytes / 1e9 / copy, benchmark::Counter::kIsIterationInvariantRate);
}

template <class T>
std::vector<T> filled(int64_t n, float scale = 1.0f, float shift = 0.0f) {
  std::vector<T> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = T(shift + scale * float((i * 7919) % 1000) / 1000.0f);
  return v;
}

DType dtype_arg(int64_t a) { return a == 0 ? DType::f32 : DType::bf16; }
size_t elsize(DType dt) { return dt == DType::f32 ? 4 : 2; }

// A raw buffer of n elements of dt with deterministic values in [shift, shift + scale).
struct Buf {
  std::vector<float> f;
  std::vector<BFloat16> h;
  Buf(DType dt, int64_t n, float scale = 1.0f, float shift = -0.5f) {
    if (dt == DType::f32) f = filled<float>(n, scale, shift);
    else h = filled<BFloat16>(n, scale, shift);
  }
  void* p() { return f.empty() ? static_cast<void*>(h.data()) : static_cast<void*>(f.data()); }
};

// ---- copy rows: the reference alone, at the sizes below ----

void BM_copy(benchmark::State& state) {
  const size_t n = size_t(state.range(0)) << 20;  // MiB per side
  std::vector<char> a(n, 1), b(n, 0);
  for (auto _ : state) {
    parallel_copy(b.data(), a.data(), n);
    benchmark::DoNotOptimize(b.data());
  }
  bench::set_bandwidth(state, 2.0 * double(n));
}
BENCHMARK(BM_copy)->ArgName("MiB")->Arg(2)->Arg(8)->Arg(64)->Unit(benchmark::kMicrosecond)->UseRealTime();

// ---- RMSNorm: fwd reads x, writes y; bwd reads g and x, writes grad_x (rstd and weight are
// per-row / per-column, counted too) ----

void BM_rms_norm_fwd(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const DType dt = dtype_arg(state.range(2));
  Buf x(dt, rows * cols), y(dt, rows * cols), w(dt, cols, 0.5f, 0.75f);
  std::vector<float> rstd(static_cast<size_t>(rows));
  const double bytes = double(2 * rows * cols + cols) * double(elsize(dt)) + 4.0 * double(rows);
  const double copy = copy_gbps(bytes);
  for (auto _ : state) kc::rms_norm_forward(dt, y.p(), rstd.data(), x.p(), w.p(), rows, cols, 1e-5);
  report(state, bytes, copy);
}

void BM_rms_norm_bwd(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const DType dt = dtype_arg(state.range(2));
  Buf x(dt, rows * cols), g(dt, rows * cols), gx(dt, rows * cols), w(dt, cols, 0.5f, 0.75f), gw(dt, cols);
  std::vector<float> rstd(size_t(rows), 1.5f);
  const double bytes = double(3 * rows * cols + 2 * cols) * double(elsize(dt)) + 4.0 * double(rows);
  const double copy = copy_gbps(bytes);
  for (auto _ : state) kc::rms_norm_backward(dt, gx.p(), gw.p(), g.p(), x.p(), w.p(), rstd.data(), rows, cols);
  report(state, bytes, copy);
}

// Residual + RMSNorm in one pass: fwd reads x and r, writes h and y (4 passes where an add then
// a norm take 5); bwd reads g, g_h and h, writes grad_h (4 where the norm's backward and the
// gradient accumulation take 6).
void BM_add_rms_norm_fwd(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const DType dt = dtype_arg(state.range(2));
  Buf x(dt, rows * cols), r(dt, rows * cols), h(dt, rows * cols), y(dt, rows * cols), w(dt, cols, 0.5f, 0.75f);
  std::vector<float> rstd(static_cast<size_t>(rows));
  const double bytes = double(4 * rows * cols + cols) * double(elsize(dt)) + 4.0 * double(rows);
  const double copy = copy_gbps(bytes);
  for (auto _ : state) kc::add_rms_norm_forward(dt, h.p(), y.p(), rstd.data(), x.p(), r.p(), w.p(), rows, cols, 1e-5);
  report(state, bytes, copy);
}

void BM_add_rms_norm_bwd(benchmark::State& state) {
  const int64_t rows = state.range(0), cols = state.range(1);
  const DType dt = dtype_arg(state.range(2));
  Buf h(dt, rows * cols), g(dt, rows * cols), gh(dt, rows * cols), out(dt, rows * cols), w(dt, cols, 0.5f, 0.75f),
      gw(dt, cols);
  std::vector<float> rstd(size_t(rows), 1.5f);
  const double bytes = double(4 * rows * cols + 2 * cols) * double(elsize(dt)) + 4.0 * double(rows);
  const double copy = copy_gbps(bytes);
  for (auto _ : state)
    kc::add_rms_norm_backward(dt, out.p(), gw.p(), g.p(), gh.p(), h.p(), w.p(), rstd.data(), rows, cols);
  report(state, bytes, copy);
}

// ---- SwiGLU: fwd reads gate and up, writes out; bwd reads g, gate and up, writes both grads ----

void BM_swiglu_fwd(benchmark::State& state) {
  const int64_t n = state.range(0) * state.range(1);
  const DType dt = dtype_arg(state.range(2));
  Buf a(dt, n, 8.0f, -4.0f), b(dt, n), o(dt, n);
  const double bytes = 3.0 * double(n) * double(elsize(dt));
  const double copy = copy_gbps(bytes);
  for (auto _ : state) kc::swiglu_forward(dt, o.p(), a.p(), b.p(), n);
  report(state, bytes, copy);
}

void BM_swiglu_bwd(benchmark::State& state) {
  const int64_t n = state.range(0) * state.range(1);
  const DType dt = dtype_arg(state.range(2));
  Buf a(dt, n, 8.0f, -4.0f), b(dt, n), g(dt, n), ga(dt, n), gb(dt, n);
  const double bytes = 5.0 * double(n) * double(elsize(dt));
  const double copy = copy_gbps(bytes);
  for (auto _ : state) kc::swiglu_backward(dt, ga.p(), gb.p(), g.p(), a.p(), b.p(), n);
  report(state, bytes, copy);
}

// ---- RoPE on q (B, H, T, D) as the model holds it: a (B, T, H, D) projection viewed as
// (B, H, T, D), rows strided; tables (T, D/2) f32. Reads x, writes a contiguous out (the tables
// are counted once). The backward is the same kernel rotating by -sin. ----

void BM_rope(benchmark::State& state) {
  const int64_t tokens = state.range(0), hidden = state.range(1), d = 64, heads = hidden / d;
  const int64_t t = 256, b = tokens / t;
  const DType dt = dtype_arg(state.range(2));
  const bool inverse = state.range(3) != 0;
  Buf x(dt, tokens * hidden), o(dt, tokens * hidden);
  std::vector<float> c = filled<float>(t * d / 2), s = filled<float>(t * d / 2);
  kc::RopeLayout l;
  l.ndim = 3;
  const int64_t lead[3] = {b, heads, t}, xs[3] = {t * heads * d, d, heads * d}, ts[3] = {0, 0, d / 2};
  for (int k = 0; k < 3; ++k) { l.lead[k] = lead[k]; l.x_strides[k] = xs[k]; l.table_strides[k] = ts[k]; }
  l.d = d;
  const double bytes = 2.0 * double(tokens * hidden) * double(elsize(dt)) + 2.0 * 4.0 * double(t * d / 2);
  const double copy = copy_gbps(bytes);
  for (auto _ : state) kc::rope_forward(dt, o.p(), x.p(), c.data(), s.data(), l, inverse);
  report(state, bytes, copy);
}

// ---- cross entropy from logits: fwd reads the logits once (keeping each row's logsumexp);
// bwd reads them once more and writes the gradient, softmax - onehot, in the same pass ----

void BM_cross_entropy_fwd(benchmark::State& state) {
  const int64_t rows = state.range(0), vocab = state.range(1);
  const DType dt = dtype_arg(state.range(2));
  Buf x(dt, rows * vocab, 8.0f, -4.0f);
  std::vector<int64_t> target(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) target[size_t(r)] = (r * 31) % vocab;
  std::vector<float> loss(static_cast<size_t>(rows)), lse(static_cast<size_t>(rows));
  const double bytes = double(rows * vocab) * double(elsize(dt)) + 16.0 * double(rows);
  const double copy = copy_gbps(bytes);
  for (auto _ : state)
    kc::cross_entropy_forward(dt, loss.data(), x.p(), DType::i64, target.data(), rows, vocab, -100, lse.data());
  report(state, bytes, copy);
}

void BM_cross_entropy_bwd(benchmark::State& state) {
  const int64_t rows = state.range(0), vocab = state.range(1);
  const DType dt = dtype_arg(state.range(2));
  Buf x(dt, rows * vocab, 8.0f, -4.0f), gx(dt, rows * vocab);
  std::vector<int64_t> target(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) target[size_t(r)] = (r * 31) % vocab;
  std::vector<float> loss(static_cast<size_t>(rows)), lse(static_cast<size_t>(rows)), scale(static_cast<size_t>(rows), 1.0f / float(rows));
  kc::cross_entropy_forward(dt, loss.data(), x.p(), DType::i64, target.data(), rows, vocab, -100, lse.data());
  const double bytes = 2.0 * double(rows * vocab) * double(elsize(dt)) + 20.0 * double(rows);
  const double copy = copy_gbps(bytes);
  const bool keep_lse = state.range(3) != 0;  // 0: the row's logsumexp recomputed (the old path)
  for (auto _ : state)
    kc::cross_entropy_backward(dt, gx.p(), x.p(), DType::i64, target.data(), scale.data(), rows, vocab, -100,
                               keep_lse ? lse.data() : nullptr);
  report(state, bytes, copy);
}

// ---- op level: the fused primitives against their composite forms (allocation included) ----

// swiglu forward: fused reads gate and up and writes out (3 passes); silu(gate) * up writes and
// rereads a temporary (5). Counted at the fused traffic for both.
void BM_swiglu_op(benchmark::State& state) {
  const bool fused = state.range(0) != 0;
  const int64_t rows = state.range(1), cols = 1376;
  Tensor a = randn({rows, cols}, RngKey(0, "a")), b = randn({rows, cols}, RngKey(0, "b"));
  const double bytes = 3.0 * double(rows * cols) * 4;
  const double copy = copy_gbps(bytes);
  for (auto _ : state) {
    Tensor y = fused ? swiglu(a, b) : silu(a) * b;
    benchmark::DoNotOptimize(y.data_ptr());
  }
  report(state, bytes, copy);
}

// rotary_embedding forward on q (B, H, T, D) viewed from (B, T, H, D): fused, or the composite
// (tables that need a gradient take it). Counted at the fused traffic for both.
void BM_rope_op(benchmark::State& state) {
  const bool fused = state.range(0) != 0;
  const int64_t tokens = state.range(1), t = 256, heads = 8, d = 64;
  Tensor x = randn({tokens / t, t, heads, d}, RngKey(0, "x")).transpose(1, 2);
  Tensor c = randn({t, d / 2}, RngKey(0, "c")), s = randn({t, d / 2}, RngKey(0, "s"));
  if (!fused) { c.set_requires_grad(); s.set_requires_grad(); }
  NoGradGuard ng;
  const double bytes = 2.0 * double(x.numel()) * 4;
  const double copy = copy_gbps(bytes);
  for (auto _ : state) {
    Tensor y = rotary_embedding(x, c, s);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  report(state, bytes, copy);
}

// Args: rows (tokens), cols, dtype (0 f32, 1 bf16).
void shapes(benchmark::internal::Benchmark* b, int64_t cols_small, int64_t cols_big) {
  b->ArgNames({"rows", "cols", "bf16"});
  for (int64_t dt : {0, 1}) {
    b->Args({2048, cols_small, dt});
    b->Args({16384, cols_big, dt});
  }
  b->Unit(benchmark::kMicrosecond)->UseRealTime();
}

}  // namespace

BENCHMARK(BM_rms_norm_fwd)->Apply([](auto* b) { shapes(b, 512, 1024); });
BENCHMARK(BM_rms_norm_bwd)->Apply([](auto* b) { shapes(b, 512, 1024); });
BENCHMARK(BM_add_rms_norm_fwd)->Apply([](auto* b) { shapes(b, 512, 1024); });
BENCHMARK(BM_add_rms_norm_bwd)->Apply([](auto* b) { shapes(b, 512, 1024); });
BENCHMARK(BM_swiglu_fwd)->Apply([](auto* b) { shapes(b, 1376, 2752); });
BENCHMARK(BM_swiglu_bwd)->Apply([](auto* b) { shapes(b, 1376, 2752); });
BENCHMARK(BM_rope)->ArgNames({"rows", "cols", "bf16", "bwd"})->Args({2048, 512, 0, 0})->Args({2048, 512, 0, 1})
    ->Args({16384, 1024, 0, 0})->Args({16384, 1024, 0, 1})->Args({2048, 512, 1, 0})->Args({16384, 1024, 1, 0})
    ->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_cross_entropy_fwd)->Apply([](auto* b) { shapes(b, 320, 4096); });
BENCHMARK(BM_cross_entropy_bwd)->ArgNames({"rows", "cols", "bf16", "lse"})->Args({2048, 320, 0, 1})
    ->Args({2048, 320, 0, 0})->Args({16384, 4096, 0, 1})->Args({16384, 4096, 0, 0})->Args({2048, 320, 1, 1})
    ->Args({16384, 4096, 1, 1})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_swiglu_op)->ArgNames({"fused", "rows"})->Args({0, 2048})->Args({1, 2048})->Args({0, 16384})
    ->Args({1, 16384})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_rope_op)->ArgNames({"fused", "rows"})->Args({0, 2048})->Args({1, 2048})->Args({0, 16384})
    ->Args({1, 16384})->Unit(benchmark::kMicrosecond)->UseRealTime();

// ---- AdamW over the 12M Llama's parameters (hidden 512, 4 layers, intermediate 1376, 8/4
// heads of 64, vocab 320, untied head): 39 f32 tensors from 512 to 704,512 elements. Each
// element reads param, grad, m, v and writes param, m, v (28 bytes). "per_tensor" calls the
// kernel once per tensor (one parallel region each); "multi" runs one region over the list. ----

namespace {

std::vector<int64_t> llama12m_sizes(int64_t scale) {
  const int64_t h = 512 * scale, inter = 1376 * scale, kv = 256 * scale, vocab = 320;
  std::vector<int64_t> s{vocab * h};
  for (int l = 0; l < 4; ++l)
    for (int64_t n : {h * h, kv * h, kv * h, h * h, inter * h, inter * h, h * inter, h, h}) s.push_back(n);
  s.push_back(h);
  s.push_back(vocab * h);
  return s;
}

void BM_adamw(benchmark::State& state) {
  const bool multi = state.range(0) != 0;
  const std::vector<int64_t> sizes = llama12m_sizes(state.range(1));
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  std::vector<std::vector<float>> p, g, m, v;
  for (int64_t n : sizes) {
    p.push_back(filled<float>(n));
    g.push_back(filled<float>(n, 1e-2f, -5e-3f));
    m.emplace_back(size_t(n), 0.0f);
    v.emplace_back(size_t(n), 0.0f);
  }
  kc::AdamWHyper h{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1,
                   .bias_correction1 = 0.1, .bias_correction2 = 0.05};
  std::vector<kc::AdamWTensor> list;
  for (size_t i = 0; i < sizes.size(); ++i)
    list.push_back({.param_dt = DType::f32, .grad_dt = DType::f32, .state_dt = DType::f32, .param = p[i].data(),
                    .grad = g[i].data(), .m = m[i].data(), .v = v[i].data(), .n = sizes[i], .hyper = h});
  const double bytes = 28.0 * double(total);
  const double copy = copy_gbps(bytes);
  for (auto _ : state) {
    if (multi) {
      kc::adamw_multi(list);
    } else {
      for (const auto& t : list) kc::adamw(t.param_dt, t.grad_dt, t.state_dt, t.param, t.grad, t.m, t.v, t.n, h);
    }
  }
  state.counters["tensors"] = double(sizes.size());
  state.counters["params_M"] = double(total) / 1e6;
  report(state, bytes, copy);
}

}  // namespace

BENCHMARK(BM_adamw)->ArgNames({"multi", "width_x"})->Args({0, 1})->Args({1, 1})->Args({0, 2})->Args({1, 2})
    ->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK_MAIN();
