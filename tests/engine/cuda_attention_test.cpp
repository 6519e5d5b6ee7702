// The CUDA flash-attention kernels (kernels/cuda/attention.cu) through scaled_dot_product_attention,
// against the CPU op (itself checked against a float64 reference in attention_test.cpp): output,
// log-sum-exp and the three gradients, causal or not, S != T, GQA, ragged tiles, documents and
// causal-by-position; the lse once more against a float64 reference computed here. Each case
// runs with both kernel choices (WMMA and mma.sync, chosen for the forward through
// set_attention_kernel and for the backward through set_attention_backward_kernel), and the
// backward once more for bit-identical gradients run twice (no atomics).
// Without a usable device every case prints why and returns.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "kernels/cuda/attention.h"
#include "tests/engine/cuda_util.h"

using namespace quilt;
using namespace quilt::cuda_test;
using kernels::cuda::AttentionKernel;

namespace {

constexpr AttentionKernel kKernels[] = {AttentionKernel::wmma, AttentionKernel::mma};

const char* kernel_name(AttentionKernel k) { return k == AttentionKernel::mma ? "mma" : "wmma"; }

// Runs the forward and backward kernels `k` until the end of the scope, then the ones chosen before.
struct UseKernel {
  AttentionKernel before = kernels::cuda::attention_kernel();
  AttentionKernel before_backward = kernels::cuda::attention_backward_kernel();
  explicit UseKernel(AttentionKernel k) {
    kernels::cuda::set_attention_kernel(k);
    kernels::cuda::set_attention_backward_kernel(k);
  }
  ~UseKernel() {
    kernels::cuda::set_attention_kernel(before);
    kernels::cuda::set_attention_backward_kernel(before_backward);
  }
  UseKernel(const UseKernel&) = delete;
  UseKernel& operator=(const UseKernel&) = delete;
};

struct Case {
  std::string name;
  int64_t b, hq, hkv, t, s, d;
  bool causal = false;
  bool docs = false;       // document ids (B, T), S == T
  bool positions = false;  // causal by position, S == T
};

double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : t.to_vector())
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

// Within rtol of each element, or `frac` of the largest element (sums of many rounded terms), or
// 1e-5 (dS = P (dP - delta) cancels: at S = 1, dP and delta are equal but for dlse).
void check_scaled(const Tensor& got, const Tensor& want, double rtol, double frac, const std::string& what) {
  check_close(got, want, rtol, std::max(frac * max_abs(want), 1e-5), what);
}

// (B, n) i32 document ids: batch row r splits at every `len[r]` tokens.
Tensor document_ids(int64_t b, int64_t n) {
  std::vector<double> ids;
  for (int64_t r = 0; r < b; ++r)
    for (int64_t i = 0; i < n; ++i) ids.push_back(double(i / (r == 0 ? 23 : 50)));
  return from_vector(ids, {b, n}, {.dtype = DType::i32});
}

// (B, n) i32 positions out of order with ties: position (7 i + r) mod n / 2 ... keeps each
// query's own key visible (its position equals itself).
Tensor positions_of(int64_t b, int64_t n) {
  std::vector<double> p;
  for (int64_t r = 0; r < b; ++r)
    for (int64_t i = 0; i < n; ++i) p.push_back(double(((7 * i + r) % n) / 2));
  return from_vector(p, {b, n}, {.dtype = DType::i32});
}

AttentionOptions options_for(const Case& c, bool on_gpu) {
  AttentionOptions o{.causal = c.causal};
  auto dev = [&](const Tensor& t) { return on_gpu ? gpu(t) : t; };
  if (c.docs) o.document_ids = dev(document_ids(c.b, c.t));
  if (c.positions) o.positions = dev(positions_of(c.b, c.t));
  return o;
}

// Forward and backward of one case on the GPU, with forward and backward kernels `kern`, against
// the CPU op.
void check_case(const Case& c, DType dt, AttentionKernel kern) {
  const UseKernel use(kern);
  const std::string what = c.name + " " + dtype_name(dt) + " " + kernel_name(kern);
  INFO(what);
  REQUIRE(kernels::cuda::attention_supported(dt, c.d, c.d));
  const Tensor q = randn({c.b, c.hq, c.t, c.d}, RngKey(11, "q"), {.dtype = dt});
  const Tensor k = randn({c.b, c.hkv, c.s, c.d}, RngKey(11, "k"), {.dtype = dt});
  const Tensor v = randn({c.b, c.hkv, c.s, c.d}, RngKey(11, "v"), {.dtype = dt});
  const Tensor go = randn({c.b, c.hq, c.t, c.d}, RngKey(11, "go"), {.dtype = dt});
  const Tensor gl = randn({c.b, c.hq, c.t}, RngKey(11, "gl"), {.dtype = DType::f32});

  Tensor qc = q.detach(), kc = k.detach(), vc = v.detach();
  Tensor qg = gpu(q).detach(), kg = gpu(k).detach(), vg = gpu(v).detach();
  for (Tensor* t : {&qc, &kc, &vc, &qg, &kg, &vg}) t->set_requires_grad(true);
  const AttentionOutput rc = scaled_dot_product_attention(qc, kc, vc, options_for(c, false));
  const AttentionOutput rg = scaled_dot_product_attention(qg, kg, vg, options_for(c, true));

  const bool f32 = dt == DType::f32;
  check_scaled(rg.out, rc.out, f32 ? 1e-4 : 2e-2, f32 ? 1e-5 : 1e-2, what + " out");
  check_close(rg.lse, rc.lse, f32 ? 1e-5 : 1e-4, f32 ? 1e-5 : 1e-3, what + " lse");

  ((rc.out * go).sum() + (rc.lse * gl).sum()).backward();
  ((rg.out * gpu(go)).sum() + (rg.lse * gpu(gl)).sum()).backward();
  const double rt = f32 ? 1e-4 : 3e-2, frac = f32 ? 1e-5 : 2e-2;
  check_scaled(qg.grad(), qc.grad(), rt, frac, what + " dq");
  check_scaled(kg.grad(), kc.grad(), rt, frac, what + " dk");
  check_scaled(vg.grad(), vc.grad(), rt, frac, what + " dv");
}

// A causal f32 call of (1, 2, t, d) from `seed` on the GPU against the CPU op.
void check_f32_causal(int64_t t, int64_t d, uint64_t seed, double lse_rtol, const std::string& what) {
  const Tensor q = randn({1, 2, t, d}, RngKey(seed, "q"));
  const Tensor k = randn({1, 2, t, d}, RngKey(seed, "k"));
  const Tensor v = randn({1, 2, t, d}, RngKey(seed, "v"));
  const AttentionOutput rc = scaled_dot_product_attention(q, k, v, {.causal = true});
  const AttentionOutput rg = scaled_dot_product_attention(gpu(q), gpu(k), gpu(v), {.causal = true});
  check_close(rg.out, rc.out, 1e-4, 1e-5, what + " out");
  check_close(rg.lse, rc.lse, lse_rtol, 1e-5, what + " lse");
}

}  // namespace

TEST_CASE("cuda: attention forward and backward match the CPU: causal or not, GQA, ragged tiles, D = 64 and 128") {
  SKIP_WITHOUT_CUDA();
  const std::vector<Case> cases = {
      {"dense T 37 D 64", 2, 8, 2, 37, 37, 64},
      {"causal T 129 D 64", 2, 8, 2, 129, 129, 64, true},
      {"causal T 129 D 128", 2, 8, 2, 129, 129, 128, true},
      {"dense T 129 S 37 D 128", 2, 8, 2, 129, 37, 128},
      {"causal T 37 S 150 D 64 (offset 113)", 2, 8, 2, 37, 150, 64, true},
      {"causal T 150 S 37 D 64 (rows that see nothing)", 2, 4, 4, 150, 37, 64, true},
      {"causal T 1 D 128", 2, 8, 2, 1, 1, 128, true},
  };
  for (AttentionKernel kern : kKernels) {
    for (const Case& c : cases)
      for (DType dt : {DType::f32, DType::bf16}) check_case(c, dt, kern);
    check_case(cases[1], DType::f16, kern);
    check_case(cases[2], DType::f16, kern);
  }
}

TEST_CASE("cuda: attention with document ids and causal by position matches the CPU") {
  SKIP_WITHOUT_CUDA();
  const std::vector<Case> cases = {
      {"documents T 129 D 64", 2, 8, 2, 129, 129, 64, false, true},
      {"documents causal T 129 D 128", 2, 8, 2, 129, 129, 128, true, true},
      {"positions T 129 D 64", 2, 8, 2, 129, 129, 64, true, false, true},
      {"positions and documents T 200 D 128", 2, 4, 1, 200, 200, 128, true, true, true},
  };
  for (AttentionKernel kern : kKernels)
    for (const Case& c : cases)
      for (DType dt : {DType::f32, DType::bf16, DType::f16}) check_case(c, dt, kern);
}

TEST_CASE("cuda: attention lse matches a float64 log-sum-exp of the scores") {
  SKIP_WITHOUT_CUDA();
  const int64_t b = 2, hq = 8, hkv = 2, t = 129, d = 64, g = hq / hkv;
  for (AttentionKernel kern : kKernels) {
    const UseKernel use(kern);
    for (bool causal : {false, true}) {
      const Tensor q = randn({b, hq, t, d}, RngKey(12, "q"), {.dtype = DType::bf16});
      const Tensor k = randn({b, hkv, t, d}, RngKey(12, "k"), {.dtype = DType::bf16});
      const Tensor v = randn({b, hkv, t, d}, RngKey(12, "v"), {.dtype = DType::bf16});
      const AttentionOutput r = scaled_dot_product_attention(gpu(q), gpu(k), gpu(v), {.causal = causal});
      const std::vector<double> qv = q.to_vector(), kv = k.to_vector();
      std::vector<double> want(size_t(b * hq * t));
      const double scale = 1.0 / std::sqrt(double(d));
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t h = 0; h < hq; ++h)
          for (int64_t i = 0; i < t; ++i) {
            std::vector<double> s;
            for (int64_t j = 0; j < (causal ? i + 1 : t); ++j) {
              double dot = 0;
              for (int64_t c = 0; c < d; ++c)
                dot += qv[size_t(((bi * hq + h) * t + i) * d + c)] * kv[size_t(((bi * hkv + h / g) * t + j) * d + c)];
              s.push_back(dot * scale);
            }
            const double top = *std::max_element(s.begin(), s.end());
            double z = 0;
            for (double x : s) z += std::exp(x - top);
            want[size_t((bi * hq + h) * t + i)] = top + std::log(z);
          }
      check_close(r.lse, from_vector(want, {b, hq, t}, {.dtype = DType::f32}), 1e-5, 1e-4,
                  std::string(causal ? "lse causal " : "lse ") + kernel_name(kern));
    }
  }
}

TEST_CASE("cuda: attention head dims the kernels do not take run the composite") {
  SKIP_WITHOUT_CUDA();
  CHECK_FALSE(kernels::cuda::attention_supported(DType::bf16, 32, 32));
  CHECK_FALSE(kernels::cuda::attention_supported(DType::f64, 64, 64));
  CHECK_FALSE(kernels::cuda::attention_supported(DType::f32, 64, 128));
  check_f32_causal(20, 32, 13, 1e-4, "composite");
}

TEST_CASE("cuda: attention fused and composite agree on the GPU, bf16 causal D 128") {
  SKIP_WITHOUT_CUDA();
  for (AttentionKernel kern : kKernels) {
    const UseKernel use(kern);
    const std::string name = kernel_name(kern);
    const Tensor q = gpu(randn({1, 4, 300, 128}, RngKey(14, "q"), {.dtype = DType::bf16}));
    const Tensor k = gpu(randn({1, 4, 300, 128}, RngKey(14, "k"), {.dtype = DType::bf16}));
    const Tensor v = gpu(randn({1, 4, 300, 128}, RngKey(14, "v"), {.dtype = DType::bf16}));
    const AttentionOutput fused = scaled_dot_product_attention(q, k, v, {.causal = true});
    const AttentionOutput comp = scaled_dot_product_attention(q, k, v, {.causal = true, .composite = true});
    check_scaled(fused.out, comp.out, 3e-2, 3e-2, "fused vs composite out " + name);
    check_close(fused.lse, comp.lse, 1e-2, 1e-2, "fused vs composite lse " + name);
  }
}

TEST_CASE("cuda: attention backward gives bit-identical gradients run twice, with either kernel choice") {
  SKIP_WITHOUT_CUDA();
  for (AttentionKernel kern : kKernels) {
    const UseKernel use(kern);
    const Tensor q = gpu(randn({2, 8, 300, 64}, RngKey(16, "q"), {.dtype = DType::bf16}));
    const Tensor k = gpu(randn({2, 2, 300, 64}, RngKey(16, "k"), {.dtype = DType::bf16}));
    const Tensor v = gpu(randn({2, 2, 300, 64}, RngKey(16, "v"), {.dtype = DType::bf16}));
    const Tensor go = gpu(randn({2, 8, 300, 64}, RngKey(16, "go"), {.dtype = DType::bf16}));
    std::vector<std::vector<double>> runs[2];
    for (auto& run : runs) {
      Tensor qg = q.detach(), kg = k.detach(), vg = v.detach();
      for (Tensor* t : {&qg, &kg, &vg}) t->set_requires_grad(true);
      (scaled_dot_product_attention(qg, kg, vg, {.causal = true}).out * go).sum().backward();
      run = {qg.grad().to_vector(), kg.grad().to_vector(), vg.grad().to_vector()};
    }
    for (int i = 0; i < 3; ++i) CHECK_MESSAGE(runs[0][i] == runs[1][i], kernel_name(kern), " gradient ", i);
  }
}

TEST_CASE("cuda: attention kernel choice is kept until changed, and f32 falls back to WMMA") {
  const AttentionKernel before = kernels::cuda::attention_kernel();
  const AttentionKernel before_backward = kernels::cuda::attention_backward_kernel();
  for (AttentionKernel k : {AttentionKernel::wmma, AttentionKernel::mma}) {
    const UseKernel use(k);
    CHECK(kernels::cuda::attention_kernel() == k);
    CHECK(kernels::cuda::attention_backward_kernel() == k);
  }
  CHECK(kernels::cuda::attention_kernel() == before);
  CHECK(kernels::cuda::attention_backward_kernel() == before_backward);
  SKIP_WITHOUT_CUDA();
  const UseKernel use(AttentionKernel::mma);
  check_f32_causal(70, 64, 15, 1e-5, "f32 under mma");
}
