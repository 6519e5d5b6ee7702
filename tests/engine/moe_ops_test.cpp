// Mixture-of-experts ops (engine/ops/moe.h) against naive float64 references written here:
// grouped_mm through the op harness (f64/f32, transposed and strided views, bf16/f16, gradcheck)
// with empty, single, many tiny and large skewed groups; moe_route against a stable sort;
// moe_permute / moe_unpermute against loops, with their gradients, bit-identical results across
// runs and thread counts, and every error path.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "engine/ops/moe.h"
#include "op_harness.h"

using namespace quilt;
using namespace quilt::test;

namespace {

Tensor offsets_tensor(const std::vector<int64_t>& off, DType dt = DType::i64) {
  return from_vector(std::vector<double>(off.begin(), off.end()), {int64_t(off.size())}, {.dtype = dt});
}

std::vector<int64_t> cumulative(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size());
  std::partial_sum(counts.begin(), counts.end(), off.begin());
  return off;
}

// ---- naive float64 references ----

// out[i] = x[i] @ w[group of i]; the group of row i is the first e with offsets[e] > i.
Ref grouped_mm_ref(const Ref& x, const Ref& w, const std::vector<int64_t>& off) {
  const int64_t m = x.shape[0], k = x.shape[1], n = w.shape[2];
  Ref out({m, n});
  size_t e = 0;
  for (int64_t i = 0; i < m; ++i) {
    while (off[e] <= i) ++e;
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t q = 0; q < k; ++q) acc += x[i * k + q] * w[(int64_t(e) * k + q) * n + j];
      out[i * n + j] = acc;
    }
  }
  return out;
}

// dw_e = x_e^T dy_e (zeros for an empty group).
Ref weight_grad_ref(const Ref& x, const Ref& dy, const std::vector<int64_t>& off) {
  const int64_t k = x.shape[1], n = dy.shape[1], e_count = int64_t(off.size());
  Ref dw({e_count, k, n});
  for (int64_t e = 0, start = 0; e < e_count; start = off[size_t(e)], ++e)
    for (int64_t i = start; i < off[size_t(e)]; ++i)
      for (int64_t q = 0; q < k; ++q)
        for (int64_t j = 0; j < n; ++j) dw[(e * k + q) * n + j] += x[i * k + q] * dy[i * n + j];
  return dw;
}

// Stable order of slots by expert.
std::vector<int64_t> route_ref(const std::vector<int64_t>& idx, int64_t num_experts) {
  std::vector<int64_t> order(idx.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return idx[size_t(a)] < idx[size_t(b)]; });
  return order;
}

Ref permute_ref(const Ref& x, const std::vector<int64_t>& order, int64_t k) {
  const int64_t h = x.shape[1], n = int64_t(order.size());
  Ref out({n, h});
  for (int64_t p = 0; p < n; ++p)
    for (int64_t c = 0; c < h; ++c) out[p * h + c] = x[order[size_t(p)] / k * h + c];
  return out;
}

Ref unpermute_ref(const Ref& y, const std::vector<int64_t>& order, const Ref& w) {
  const int64_t t_count = w.shape[0], k = w.shape[1], h = y.shape[1];
  std::vector<int64_t> row(order.size());
  for (size_t p = 0; p < order.size(); ++p) row[size_t(order[p])] = int64_t(p);
  Ref out({t_count, h});
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t c = 0; c < h; ++c) out[t * h + c] += w[t * k + j] * y[row[size_t(t * k + j)] * h + c];
  return out;
}

// Random expert choices (T, k): k distinct experts per token, as a top-k router gives.
std::vector<int64_t> random_choices(int64_t tokens, int64_t k, int64_t num_experts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int64_t> all(static_cast<size_t>(num_experts)), idx;
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    idx.insert(idx.end(), all.begin(), all.begin() + k);
  }
  return idx;
}

Tensor index_tensor(const std::vector<int64_t>& v, const Shape& shape, DType dt = DType::i64) {
  return from_vector(std::vector<double>(v.begin(), v.end()), shape, {.dtype = dt});
}

// A harness case for grouped_mm over the given group sizes. The op moves the offsets to the
// inputs' device, so the harness's GPU pass runs the case too (as in every case below).
void run_grouped_case(const std::string& name, const std::vector<int64_t>& counts, int64_t k, int64_t n,
                      DType offsets_dtype = DType::i64) {
  const std::vector<int64_t> off = cumulative(counts);
  const int64_t m = off.empty() ? 0 : off.back(), e = int64_t(counts.size());
  const Tensor offsets = offsets_tensor(off, offsets_dtype);
  run_op_case({.name = name,
               .inputs = {{{m, k}}, {{e, k, n}}},
               .op = [offsets](const V& x) { return V{grouped_mm(x[0], x[1], offsets.to(x[0].device()))}; },
               .ref = [off](const R& r) { return R{grouped_mm_ref(r[0], r[1], off)}; }});
}

// True when a and b have one shape and differ by at most tol anywhere (the worst is printed).
bool all_close(const Tensor& a, const Tensor& b, double tol) {
  if (a.shape() != b.shape()) return false;
  const auto va = a.to_vector(), vb = b.to_vector();
  double worst = 0;
  for (size_t i = 0; i < va.size(); ++i) worst = std::max(worst, std::abs(va[i] - vb[i]));
  if (worst > tol) MESSAGE("largest difference ", worst, " (tolerance ", tol, ")");
  return worst <= tol;
}

// |a - b| <= rel * (1 + |b|) everywhere.
bool rel_close(const Tensor& a, const Tensor& b, double rel) {
  if (a.shape() != b.shape()) return false;
  const auto va = a.to_vector(), vb = b.to_vector();
  for (size_t i = 0; i < va.size(); ++i)
    if (!(std::abs(va[i] - vb[i]) <= rel * (1 + std::abs(vb[i])))) {
      MESSAGE("element ", i, ": ", va[i], " vs ", vb[i]);
      return false;
    }
  return true;
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

// Runs f with 1 thread and then with 2 (or more), restoring the thread count.
template <class F>
auto with_threads(int n, F&& f) {
  const int before = omp_get_max_threads();
  omp_set_num_threads(n);
  auto out = f();
  omp_set_num_threads(before);
  return out;
}

}  // namespace

// ---- grouped_mm ----

TEST_CASE("grouped_mm: matches a float64 reference with empty experts") {
  run_grouped_case("grouped_mm, empty groups first, middle and last", {0, 3, 0, 0, 5, 1, 0}, 4, 6);
  run_grouped_case("grouped_mm, i32 offsets", {2, 0, 3}, 5, 3, DType::i32);
  run_grouped_case("grouped_mm, every group empty", {0, 0, 0}, 4, 3);
}

TEST_CASE("grouped_mm: one expert is a plain matmul") {
  run_grouped_case("grouped_mm, one group", {7}, 5, 4);
  Tensor x = randn({9, 6}, RngKey(1, "x"), {.dtype = DType::f64});
  Tensor w = randn({1, 6, 5}, RngKey(1, "w"), {.dtype = DType::f64});
  Tensor y = grouped_mm(x, w, offsets_tensor({9}));
  CHECK(all_close(y, matmul(x, w.select(0, 0)), 1e-12));
  // K = 0: every row is an empty sum.
  CHECK(all_close(grouped_mm(zeros({3, 0}), zeros({2, 0, 4}), offsets_tensor({1, 3})), zeros({3, 4}), 0.0));
}

TEST_CASE("grouped_mm: 64 experts with 0 to 3 rows each match the reference, forward and backward") {
  std::mt19937 rng(64);
  std::vector<int64_t> counts(64);
  for (auto& c : counts) c = std::uniform_int_distribution<int64_t>(0, 3)(rng);
  run_grouped_case("grouped_mm, 64 tiny groups", counts, 3, 2);
}

TEST_CASE("grouped_mm: a transposed (E, N, K) weight view gives the result and gradient of the contiguous one") {
  const std::vector<int64_t> off = cumulative({3, 0, 4, 2});
  const Tensor offsets = offsets_tensor(off);
  Tensor x = randn({9, 5}, RngKey(2, "x"), {.dtype = DType::f64});
  Tensor wt = randn({4, 6, 5}, RngKey(2, "wt"), {.dtype = DType::f64}).set_requires_grad();  // (E, N, K)
  Tensor w = transpose(wt, 1, 2);                                                             // (E, K, N) view
  REQUIRE_FALSE(w.is_contiguous());
  Tensor y = grouped_mm(x, w, offsets);
  Tensor y_ref = grouped_mm(x, contiguous(w), offsets);
  CHECK(all_close(y, y_ref, 1e-12));  // Eigen packs a transposed operand its own way
  const Ref want = grouped_mm_ref(Ref::of(x), Ref::of(contiguous(w)), off);
  CHECK(all_close(y, from_vector(want.v, want.shape, {.dtype = DType::f64}), 1e-12));
  Tensor g = randn({9, 6}, RngKey(2, "g"), {.dtype = DType::f64});
  sum(y * g).backward();
  REQUIRE(wt.grad().defined());
  CHECK(wt.grad().shape() == Shape{4, 6, 5});
  CHECK(wt.grad().is_contiguous());  // computed in the weight's storage order, no copy needed
  const Ref dw = weight_grad_ref(Ref::of(x), Ref::of(g), off);  // (E, K, N)
  Tensor dw_t = transpose(from_vector(dw.v, dw.shape, {.dtype = DType::f64}), 1, 2);
  CHECK(all_close(wt.grad(), dw_t, 1e-12));
  // The harness also runs every case with transposed views of x and w (its non-contiguous pass).
}

TEST_CASE("grouped_mm: bf16 and f16 agree with f32 on the same rounded inputs") {
  const std::vector<int64_t> off = cumulative({40, 0, 300, 7, 93});
  const Tensor offsets = offsets_tensor(off);
  Tensor x = randn({440, 96}, RngKey(3, "x")), w = randn({5, 96, 70}, RngKey(3, "w"));
  for (DType dt : {DType::bf16, DType::f16}) {
    INFO("dtype ", dtype_name(dt));
    Tensor xl = x.to(dt), wl = w.to(dt);
    Tensor want = grouped_mm(xl.to(DType::f32), wl.to(DType::f32), offsets);  // f32 on the rounded inputs
    Tensor got = grouped_mm(xl, wl, offsets);
    CHECK(got.dtype() == dt);
    // One rounding of an f32 accumulation: within half an ulp of the output's dtype.
    const double ulp = dt == DType::bf16 ? 1.0 / 128 : 1.0 / 1024;
    const auto a = got.to_vector(), b = want.to_vector();
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (std::abs(b[i]) + 1e-3));
    CHECK(worst <= ulp * 0.5 + 1e-6);
    // The gradients too (computed in f32 and rounded).
    Tensor xg = xl.clone().set_requires_grad(), wg = wl.clone().set_requires_grad();
    sum(grouped_mm(xg, wg, offsets)).backward();
    Tensor x32 = xl.to(DType::f32).set_requires_grad(), w32 = wl.to(DType::f32).set_requires_grad();
    sum(grouped_mm(x32, w32, offsets)).backward();
    CHECK(rel_close(xg.grad().to(DType::f32), x32.grad(), ulp));
    CHECK(rel_close(wg.grad().to(DType::f32), w32.grad(), ulp));
  }
}

TEST_CASE("grouped_mm: large skewed groups are cut into tiles that match the reference in every dtype") {
  // A group of 700 rows (several row tiles) beside small ones, N = 300 (several column tiles).
  const std::vector<int64_t> off = cumulative({700, 1, 0, 37, 262});
  const Tensor offsets = offsets_tensor(off);
  Tensor x = randn({1000, 24}, RngKey(4, "x"), {.dtype = DType::f64});
  Tensor w = randn({5, 24, 300}, RngKey(4, "w"), {.dtype = DType::f64});
  Tensor g = randn({1000, 300}, RngKey(4, "g"), {.dtype = DType::f64});
  const Ref want = grouped_mm_ref(Ref::of(x), Ref::of(w), off);
  const Ref want_dw = weight_grad_ref(Ref::of(x), Ref::of(g), off);
  for (DType dt : {DType::f64, DType::f32}) {
    INFO("dtype ", dtype_name(dt));
    const double tol = dt == DType::f64 ? 1e-11 : 1e-4;
    Tensor xd = x.to(dt), wd = w.to(dt).detach().set_requires_grad();
    Tensor y = grouped_mm(xd, wd, offsets);
    CHECK(all_close(y.to(DType::f64), from_vector(want.v, want.shape, {.dtype = DType::f64}), tol));
    sum(y * g.to(dt)).backward();
    CHECK(all_close(wd.grad().to(DType::f64), from_vector(want_dw.v, want_dw.shape, {.dtype = DType::f64}),
                          tol * 30));
  }
}

TEST_CASE("grouped_mm: results and gradients are bit-identical across runs and thread counts") {
  const Tensor offsets = offsets_tensor(cumulative({513, 0, 2, 130, 64, 1}));
  // bf16 too: its tiles run natively on CPUs with AVX512-BF16 (oneDNN), else widened to f32.
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO("dtype ", dtype_name(dt));
    Tensor x = randn({710, 200}, RngKey(5, "x")).to(dt), w = randn({6, 200, 300}, RngKey(5, "w")).to(dt);
    Tensor g = randn({710, 300}, RngKey(5, "g")).to(dt);
    auto run = [&] {
      Tensor xg = x.clone().set_requires_grad(), wg = w.clone().set_requires_grad();
      Tensor y = grouped_mm(xg, wg, offsets);
      sum(y * g).backward();
      return std::vector<Tensor>{y, xg.grad(), wg.grad()};
    };
    const int threads = omp_get_max_threads();
    const auto a = with_threads(1, run);
    const auto b = with_threads(std::max(2, threads), run);
    const auto c = run();
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(bit_equal(a[i], b[i]));
      CHECK(bit_equal(b[i], c[i]));
    }
    CHECK(omp_get_max_threads() == threads);  // the kernels' per-thread Eigen setting does not leak out
  }
}

TEST_CASE("grouped_mm: its backward is made of ops and differentiates again") {
  // dx and dw as functions of the incoming gradient, through the harness's finite differences:
  // that runs grouped_mm_weight_grad's own backward too. (Saved inputs are detached, as in every
  // primitive, so the second derivative is taken w.r.t. the incoming gradient only.)
  const std::vector<int64_t> off = cumulative({2, 0, 3});
  const Tensor offsets = offsets_tensor(off);
  run_op_case({.name = "grouped_mm double backward",
               .inputs = {{{5, 4}, Gen::normal, false}, {{3, 4, 3}, Gen::normal, false}, {{5, 3}}},
               .op =
                   [offsets](const V& in) {
                     EnableGradGuard eg;  // the finite-difference passes run under NoGradGuard
                     Tensor x = in[0].requires_grad() ? in[0] : in[0].detach().set_requires_grad();
                     Tensor w = in[1].requires_grad() ? in[1] : in[1].detach().set_requires_grad();
                     auto gs = grad({grouped_mm(x, w, offsets.to(x.device()))}, {x, w}, {in[2]}, true, true);
                     return V{gs[0], gs[1]};
                   },
               .ref =
                   [off](const R& r) {
                     // dx_e = g_e w_e^T, dw_e = x_e^T g_e.
                     Ref wt({3, 3, 4});
                     for (int64_t e = 0; e < 3; ++e)
                       for (int64_t q = 0; q < 4; ++q)
                         for (int64_t j = 0; j < 3; ++j) wt[(e * 3 + j) * 4 + q] = r[1][(e * 4 + q) * 3 + j];
                     return R{grouped_mm_ref(r[2], wt, off), weight_grad_ref(r[0], r[2], off)};
                   },
               .lowp = false,
               .noncontig = false});
}

TEST_CASE("grouped_mm: bad shapes, dtypes and offsets throw naming the op and the values") {
  Tensor x = zeros({8, 4}), w = zeros({3, 4, 5});
  Tensor off = offsets_tensor({2, 5, 8});
  CHECK_THROWS_WITH_AS(grouped_mm(zeros({8}), w, off), doctest::Contains("[grouped_mm] x must be 2-D (M, K), got shape (8,)"),
                       Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, zeros({4, 5}), off),
                       doctest::Contains("[grouped_mm] w must be 3-D (E, K, N), got shape (4, 5)"), Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, zeros({3, 4, 5}, {.dtype = DType::bf16}), off),
                       doctest::Contains("[grouped_mm] needs floating x and w of one dtype, got f32 and bf16"), Error);
  CHECK_THROWS_WITH_AS(grouped_mm(zeros({8, 4}, {.dtype = DType::i64}), zeros({3, 4, 5}, {.dtype = DType::i64}), off),
                       doctest::Contains("[grouped_mm] needs floating x and w of one dtype, got i64 and i64"), Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, zeros({3, 6, 5}), off),
                       doctest::Contains("[grouped_mm] inner dims differ: x (8, 4) @ w (3, 6, 5)"), Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, w, offsets_tensor({2, 8})),
                       doctest::Contains("[grouped_mm] offsets must be a 1-D i32/i64 tensor of E = 3 entries (w (3, 4, 5)), "
                                         "got i64 of shape (2,)"),
                       Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, w, from_vector({2, 5, 8}, {3})),
                       doctest::Contains("[grouped_mm] offsets must be a 1-D i32/i64 tensor of E = 3 entries (w (3, 4, 5)), "
                                         "got f32 of shape (3,)"),
                       Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, w, offsets_tensor({2, 5, 8}).reshape({1, 3})),
                       doctest::Contains("[grouped_mm] offsets must be a 1-D i32/i64 tensor"), Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, w, offsets_tensor({5, 2, 8})),
                       doctest::Contains("[grouped_mm] offsets[1] = 2 is less than offsets[0] = 5 (offsets must be "
                                         "non-decreasing)"),
                       Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, w, offsets_tensor({-1, 5, 8})),
                       doctest::Contains("[grouped_mm] offsets[0] = -1 is negative"), Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, w, offsets_tensor({2, 5, 7})),
                       doctest::Contains("[grouped_mm] offsets[2] = 7 (the last) must equal the rows of x (8, 4), 8"),
                       Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, w, offsets_tensor({2, 9, 9}, DType::i32)),
                       doctest::Contains("[grouped_mm] offsets[2] = 9 (the last) must equal the rows of x (8, 4), 8"),
                       Error);
  CHECK_THROWS_WITH_AS(grouped_mm(x, zeros({0, 4, 5}), offsets_tensor({})),
                       doctest::Contains("[grouped_mm] offsets is empty (no groups) but x (8, 4) has 8 rows"), Error);
}

// ---- moe_route ----

TEST_CASE("moe_route: orders slots by expert, ties in slot order, with counts and offsets") {
  for (DType dt : {DType::i64, DType::i32}) {
    const int64_t tokens = 37, k = 3, experts = 9;
    std::vector<int64_t> idx = random_choices(tokens, k, experts - 1, 11);  // expert 8 gets no token
    MoeRouting r = moe_route(index_tensor(idx, {tokens, k}, dt), experts);
    const std::vector<int64_t> want = route_ref(idx, experts);
    REQUIRE(r.order.dtype() == DType::i64);
    CHECK(r.order.shape() == Shape{tokens * k});
    CHECK(r.order.to_vector() == std::vector<double>(want.begin(), want.end()));
    std::vector<int64_t> counts(size_t(experts), 0);
    for (int64_t e : idx) ++counts[size_t(e)];
    const std::vector<int64_t> off = cumulative(counts);
    CHECK(r.counts.to_vector() == std::vector<double>(counts.begin(), counts.end()));
    CHECK(r.offsets.to_vector() == std::vector<double>(off.begin(), off.end()));
    CHECK(r.host_counts == counts);
  }
  // Repeated experts within a token keep their slot order too.
  MoeRouting r = moe_route(index_tensor({1, 1, 0, 1}, {2, 2}), 2);
  CHECK(r.order.to_vector() == std::vector<double>{2, 0, 1, 3});
  CHECK(r.host_counts == std::vector<int64_t>{1, 3});
  MoeRouting empty = moe_route(index_tensor({}, {0, 2}), 3);
  CHECK(empty.order.numel() == 0);
  CHECK(empty.host_counts == std::vector<int64_t>{0, 0, 0});
}

TEST_CASE("moe_route: an expert index below 0 or not below E throws naming the first one") {
  CHECK_THROWS_WITH_AS(moe_route(index_tensor({0, 1, 2, 4, 7, 1}, {3, 2}), 4),
                       doctest::Contains("[moe_route] expert_idx[1, 1] = 4 is outside [0, 4) (num_experts = 4)"), Error);
  CHECK_THROWS_WITH_AS(moe_route(index_tensor({0, -1}, {1, 2}, DType::i32), 4),
                       doctest::Contains("[moe_route] expert_idx[0, 1] = -1 is outside [0, 4)"), Error);
  CHECK_THROWS_WITH_AS(moe_route(zeros({2, 2}), 4), doctest::Contains("[moe_route] expert_idx must be an i32 or i64 tensor, got f32"),
                       Error);
  CHECK_THROWS_WITH_AS(moe_route(index_tensor({0, 1}, {2}), 4),
                       doctest::Contains("[moe_route] expert_idx must be 2-D (T, k), got shape (2,)"), Error);
  CHECK_THROWS_WITH_AS(moe_route(index_tensor({0, 1}, {1, 2}), 0),
                       doctest::Contains("[moe_route] num_experts must be positive, got 0"), Error);
}

// ---- moe_permute / moe_unpermute ----

TEST_CASE("moe_permute: copies token rows into routed order and its gradient sums each token's rows") {
  const int64_t tokens = 6, k = 2, h = 5;
  const std::vector<int64_t> order = route_ref(random_choices(tokens, k, 4, 21), 4);
  const Tensor ord = index_tensor(order, {tokens * k});
  run_op_case({.name = "moe_permute",
               .inputs = {{{tokens, h}}},
               .op = [ord](const V& x) { return V{moe_permute(x[0], ord.to(x[0].device()), k)}; },
               .ref = [order](const R& r) { return R{permute_ref(r[0], order, k)}; }});
  // The gradient: each token's k rows summed (weights of ones), in slot order.
  Tensor x = randn({tokens, h}, RngKey(6, "x"), {.dtype = DType::f64}).set_requires_grad();
  Tensor g = randn({tokens * k, h}, RngKey(6, "g"), {.dtype = DType::f64});
  sum(moe_permute(x, ord, k) * g).backward();
  const Ref want = unpermute_ref(Ref::of(g), order, Ref({tokens, k}, 1.0));
  CHECK(all_close(x.grad(), from_vector(want.v, want.shape, {.dtype = DType::f64}), 0.0));
}

TEST_CASE("moe_unpermute: combines in slot order and matches its reference, with gradients to y and weights") {
  const int64_t tokens = 5, k = 3, h = 4;
  const std::vector<int64_t> order = route_ref(random_choices(tokens, k, 6, 31), 6);
  const Tensor ord = index_tensor(order, {tokens * k}, DType::i32);
  run_op_case({.name = "moe_unpermute",
               .inputs = {{{tokens * k, h}}, {{tokens, k}, Gen::unit}},
               .op = [ord](const V& x) { return V{moe_unpermute(x[0], ord.to(x[0].device()), x[1])}; },
               .ref = [order](const R& r) { return R{unpermute_ref(r[0], order, r[1])}; }});
  // Weights of another dtype are cast to y's, and their gradient comes back in theirs.
  Tensor y = randn({tokens * k, h}, RngKey(7, "y"), {.dtype = DType::f64});
  Tensor w = rand({tokens, k}, RngKey(7, "w")).set_requires_grad();  // f32
  Tensor out = moe_unpermute(y, ord, w);
  CHECK(out.dtype() == DType::f64);
  sum(out).backward();
  CHECK(w.grad().dtype() == DType::f32);
}

TEST_CASE("moe ops: a routed expert layer's gradients match finite differences") {
  // route -> permute -> grouped_mm -> unpermute, gradients to x, the experts' w and the weights.
  const int64_t tokens = 7, k = 2, h = 3, n = 4, experts = 4;
  const std::vector<int64_t> idx = random_choices(tokens, k, experts, 41);
  MoeRouting r = moe_route(index_tensor(idx, {tokens, k}), experts);
  const std::vector<int64_t> order = route_ref(idx, experts);
  std::vector<int64_t> counts(size_t(experts), 0);
  for (int64_t e : idx) ++counts[size_t(e)];
  const std::vector<int64_t> off = cumulative(counts);
  run_op_case({.name = "moe layer",
               .inputs = {{{tokens, h}}, {{experts, h, n}}, {{tokens, k}, Gen::unit}},
               .op =
                   [r, k](const V& x) {
                     const Tensor order = r.order.to(x[0].device()), offsets = r.offsets.to(x[0].device());
                     return V{moe_unpermute(grouped_mm(moe_permute(x[0], order, k), x[1], offsets), order, x[2])};
                   },
               .ref =
                   [order, off, k](const R& x) {
                     return R{unpermute_ref(grouped_mm_ref(permute_ref(x[0], order, k), x[1], off), order, x[2])};
                   }});
}

TEST_CASE("moe_unpermute: sums each token's rows in slot order in f32, 16-bit rounded once, for any k") {
  // k = 1, 4, 7 (a pass of 4, 2 and 1 rows), 11 (8, 2, 1) and 19 (8, 8, 2, 1): the kernel reads
  // several rows per pass, and the sums must still be the slot-by-slot ones, bit for bit.
  const int64_t tokens = 64, h = 1100;  // more than one 1024-column chunk
  for (int64_t k : {1, 4, 7, 11, 19}) {
    const std::vector<int64_t> order = route_ref(random_choices(tokens, k, 24, 51), 24);
    const Tensor ord = index_tensor(order, {tokens * k});
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      INFO("k ", k, ", dtype ", dtype_name(dt));
      Tensor y = randn({tokens * k, h}, RngKey(8, "y")).to(dt), w = rand({tokens, k}, RngKey(8, "w")).to(dt);
      Tensor out = moe_unpermute(y, ord, w);
      const auto yv = y.to_vector(), wv = w.to_vector();
      std::vector<int64_t> row(order.size());
      for (size_t p = 0; p < order.size(); ++p) row[size_t(order[p])] = int64_t(p);
      std::vector<double> want(size_t(tokens * h));
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t c = 0; c < h; ++c) {
          float acc = 0;
          for (int64_t j = 0; j < k; ++j) {
            const float wj = float(wv[size_t(t * k + j)]), yj = float(yv[size_t(row[size_t(t * k + j)] * h + c)]);
#if defined(__FP_FAST_FMAF)
            acc = j == 0 ? wj * yj : std::fma(wj, yj, acc);
#else
            acc = j == 0 ? wj * yj : acc + wj * yj;
#endif
          }
          want[size_t(t * h + c)] = acc;
        }
      CHECK(bit_equal(out, from_vector(want, {tokens, h}).to(dt)));
    }
  }
}

TEST_CASE("moe ops: permute and unpermute and their gradients are bit-identical across runs and thread counts") {
  const int64_t tokens = 600, k = 4, h = 384, experts = 16;
  const std::vector<int64_t> idx = random_choices(tokens, k, experts, 61);
  MoeRouting r = moe_route(index_tensor(idx, {tokens, k}), experts);
  Tensor x = randn({tokens, h}, RngKey(9, "x")), w = rand({tokens, k}, RngKey(9, "w"));
  Tensor scale = randn({tokens * k, h}, RngKey(9, "s")), g = randn({tokens, h}, RngKey(9, "g"));
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO("dtype ", dtype_name(dt));
    auto run = [&] {
      Tensor xg = x.to(dt).detach().set_requires_grad(), wg = w.to(dt).detach().set_requires_grad();
      Tensor y = moe_unpermute(moe_permute(xg, r.order, k) * scale.to(dt), r.order, wg);
      sum(y * g.to(dt)).backward();
      return std::vector<Tensor>{y, xg.grad(), wg.grad()};
    };
    const auto a = with_threads(1, run);
    const auto b = with_threads(std::max(2, omp_get_max_threads()), run);
    const auto c = run();
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("output ", i);
      CHECK(bit_equal(a[i], b[i]));
      CHECK(bit_equal(b[i], c[i]));
    }
  }
}

TEST_CASE("moe_permute and moe_unpermute: bad orders, shapes and dtypes throw naming the entry") {
  Tensor x = zeros({4, 3});
  Tensor ord = index_tensor({0, 1, 2, 3, 4, 5, 6, 7}, {8});
  CHECK_THROWS_WITH_AS(moe_permute(x, index_tensor({0, 1, 2, 3, 4, 5, 9, 7}, {8}), 2),
                       doctest::Contains("[moe_permute] order[6] = 9 is outside [0, 8)"), Error);
  CHECK_THROWS_WITH_AS(moe_permute(x, index_tensor({0, 1, 2, 3, 4, 2, 6, 7}, {8}), 2),
                       doctest::Contains("[moe_permute] order[5] = 2 repeats an earlier entry (order must be a "
                                         "permutation of [0, 8))"),
                       Error);
  CHECK_THROWS_WITH_AS(moe_permute(x, index_tensor({0, 1, 2}, {3}), 2),
                       doctest::Contains("[moe_permute] order has shape (3,); x (4, 3) with k = 2 needs 8 entries"), Error);
  CHECK_THROWS_WITH_AS(moe_permute(x, zeros({8}), 2),
                       doctest::Contains("[moe_permute] order must be an i32 or i64 tensor, got f32"), Error);
  CHECK_THROWS_WITH_AS(moe_permute(x, ord, 0), doctest::Contains("[moe_permute] k must be at least 1, got 0"), Error);
  CHECK_THROWS_WITH_AS(moe_permute(zeros({12}), ord, 2),
                       doctest::Contains("[moe_permute] x must be a floating 2-D tensor (T, H), got f32 of shape (12,)"),
                       Error);
  Tensor y = zeros({8, 3}), w = zeros({4, 2});
  CHECK_THROWS_WITH_AS(moe_unpermute(y, index_tensor({0, 1, 2, 3, 4, 5, 6, -1}, {8}, DType::i32), w),
                       doctest::Contains("[moe_unpermute] order[7] = -1 is outside [0, 8)"), Error);
  CHECK_THROWS_WITH_AS(moe_unpermute(y, index_tensor({1, 1, 2, 3, 4, 5, 6, 7}, {8}), w),
                       doctest::Contains("[moe_unpermute] order[1] = 1 repeats an earlier entry"), Error);
  CHECK_THROWS_WITH_AS(moe_unpermute(y, ord, zeros({3, 2})),
                       doctest::Contains("[moe_unpermute] y (8, 3) has 8 rows, but weights (3, 2) make T*k = 6"), Error);
  CHECK_THROWS_WITH_AS(moe_unpermute(y, index_tensor({0, 1}, {2}), w),
                       doctest::Contains("[moe_unpermute] order has shape (2,); y (8, 3) needs 8 entries"), Error);
  CHECK_THROWS_WITH_AS(moe_unpermute(y, ord, zeros({8})),
                       doctest::Contains("[moe_unpermute] weights must be a floating 2-D tensor (T, k), got f32 of shape (8,)"),
                       Error);
  CHECK_THROWS_WITH_AS(moe_unpermute(y, ord, zeros({4, 2}, {.dtype = DType::i64})),
                       doctest::Contains("[moe_unpermute] weights must be a floating 2-D tensor (T, k), got i64"), Error);
  CHECK_THROWS_WITH_AS(moe_unpermute(zeros({8, 3}, {.dtype = DType::i32}), ord, w),
                       doctest::Contains("[moe_unpermute] y must be a floating 2-D tensor (T*k, H), got i32 of shape (8, 3)"),
                       Error);
}
