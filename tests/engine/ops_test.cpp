// Elementwise, reduction, matmul and view ops through the op harness (op_harness.h).
#include <omp.h>

#include <cmath>
#include <limits>

#include "op_harness.h"

using namespace quilt;
using namespace quilt::test;

namespace {

double erf_gelu(double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }
double sigm(double x) { return 1 / (1 + std::exp(-x)); }

struct UnaryCase {
  const char* name;
  Tensor (*op)(const Tensor&);
  double (*ref)(double);
  Gen gen;
};

const UnaryCase kUnary[] = {
    {"neg", [](const Tensor& x) { return neg(x); }, [](double a) { return -a; }, Gen::normal},
    {"exp", [](const Tensor& x) { return exp(x); }, [](double a) { return std::exp(a); }, Gen::normal},
    {"log", [](const Tensor& x) { return log(x); }, [](double a) { return std::log(a); }, Gen::positive},
    {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double a) { return std::sqrt(a); }, Gen::positive},
    {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double a) { return 1 / std::sqrt(a); }, Gen::positive},
    {"tanh", [](const Tensor& x) { return tanh(x); }, [](double a) { return std::tanh(a); }, Gen::normal},
    {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, sigm, Gen::normal},
    {"silu", [](const Tensor& x) { return silu(x); }, [](double a) { return a * sigm(a); }, Gen::normal},
    {"gelu", [](const Tensor& x) { return gelu(x); }, erf_gelu, Gen::normal},
    {"relu", [](const Tensor& x) { return relu(x); }, [](double a) { return a > 0 ? a : 0.0; }, Gen::away_from_zero},
    {"abs", [](const Tensor& x) { return abs(x); }, [](double a) { return std::abs(a); }, Gen::away_from_zero},
    {"sin", [](const Tensor& x) { return sin(x); }, [](double a) { return std::sin(a); }, Gen::normal},
    {"cos", [](const Tensor& x) { return cos(x); }, [](double a) { return std::cos(a); }, Gen::normal},
    {"square", [](const Tensor& x) { return square(x); }, [](double a) { return a * a; }, Gen::normal},
};

struct BinaryCase {
  const char* name;
  Tensor (*op)(const Tensor&, const Tensor&);
  double (*ref)(double, double);
  Gen ga, gb;
};

const BinaryCase kBinary[] = {
    {"add", [](const Tensor& a, const Tensor& b) { return a + b; }, [](double a, double b) { return a + b; }, Gen::normal, Gen::normal},
    {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }, [](double a, double b) { return a - b; }, Gen::normal, Gen::normal},
    {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }, [](double a, double b) { return a * b; }, Gen::normal, Gen::normal},
    {"div", [](const Tensor& a, const Tensor& b) { return a / b; }, [](double a, double b) { return a / b; }, Gen::normal, Gen::away_from_zero},
    {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }, [](double a, double b) { return std::pow(a, b); }, Gen::positive, Gen::normal},
    {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }, [](double a, double b) { return std::max(a, b); }, Gen::distinct, Gen::distinct},
    {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }, [](double a, double b) { return std::min(a, b); }, Gen::distinct, Gen::distinct},
};

const std::pair<Shape, Shape> kBroadcastShapes[] = {
    {{7}, {7}}, {{3, 5}, {3, 5}}, {{3, 1}, {1, 4}}, {{2, 3, 4}, {4}}, {{5}, {}}, {{0, 3}, {3}}, {{2, 1, 3}, {2, 4, 1}},
};

}  // namespace

TEST_CASE("ops: every unary op matches its float64 reference, gradcheck and low precision") {
  for (const auto& u : kUnary) {
    for (const Shape& s : {Shape{13}, Shape{3, 7}, Shape{2, 3, 5}, Shape{}, Shape{0, 4}}) {
      run_op_case({.name = std::string(u.name) + " " + std::to_string(s.size()) + "-d",
                   .inputs = {{s, u.gen}},
                   .op = [&](const V& x) { return V{u.op(x[0])}; },
                   .ref = [&](const R& r) { return R{map(r[0], u.ref)}; },
                   .lowp_tol = std::string(u.name) == "exp" ? 4e-2 : 0.0});
    }
  }
}

// A long contiguous run in bf16 or f16 goes through the f32 form a block at a time (1024 elements,
// then sixteen-lane rounding and a tail): it must give the f32 op's answer rounded to the type, to
// within one step of the type (the f32 forms of a contiguous f32 run and of a block may differ in
// their last f32 bit, which can move a rounding by one step).
TEST_CASE("ops: every unary op on long bf16 and f16 runs is the f32 op rounded, blocks and tails included") {
  const int64_t n = 3001;  // two threads' chunks, several blocks, a tail of lanes and of elements
  for (const auto& u : kUnary) {
    const Tensor r = randn({n}, RngKey(7, u.name));
    const Tensor x = u.gen == Gen::positive ? abs(r) * 2.0 + 0.1 : r * 3.0;
    for (DType dt : {DType::bf16, DType::f16}) {
      const int mant = dt == DType::bf16 ? 7 : 10, emin = dt == DType::bf16 ? -126 : -14;
      const Tensor xl = x.to(dt);
      const std::vector<double> got = u.op(xl).to_vector(), want = u.op(xl.to(DType::f32)).to(dt).to_vector();
      REQUIRE(got.size() == size_t(n));
      int64_t off = 0, first = -1;
      for (int64_t i = 0; i < n; ++i) {
        const double g = got[size_t(i)], w = want[size_t(i)];
        if (std::isnan(w) ? std::isnan(g) : g == w) continue;
        const double step = std::ldexp(1.0, std::max(w == 0 ? emin : std::ilogb(w), emin) - mant);
        if (std::isnan(g) || std::abs(g - w) > step) {
          ++off;
          if (first < 0) first = i;
        }
      }
      const std::string what = std::string(u.name) + " in " + dtype_name(dt);
      CAPTURE(what);
      CAPTURE(first);
      CHECK(off == 0);
    }
  }
}

TEST_CASE("ops: every binary op broadcasts like NumPy and passes the harness") {
  for (const auto& b : kBinary) {
    for (const auto& [sa, sb] : kBroadcastShapes) {
      run_op_case({.name = std::string(b.name),
                   .inputs = {{sa, b.ga}, {sb, b.gb}},
                   .op = [&](const V& x) { return V{b.op(x[0], x[1])}; },
                   .ref = [&](const R& r) { return R{zip(r[0], r[1], b.ref)}; },
                   .lowp_tol = std::string(b.name) == "pow" || std::string(b.name) == "div" ? 5e-2 : 0.0});
    }
  }
}

TEST_CASE("ops: isfinite is false exactly at NaN and infinities, on floating and integer tensors") {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::f64, DType::f32, DType::bf16}) {
    const Tensor x = from_vector({1.5, -inf, 0.0, std::nan(""), inf, -2e30}, {6}, {.dtype = dt});
    const Tensor f = isfinite(x);
    CHECK(f.dtype() == DType::b8);
    CHECK(f.to_vector() == std::vector<double>{1, 0, 1, 0, 0, 1});
  }
  CHECK(isfinite(arange(0, 4).to(DType::i64)).to_vector() == std::vector<double>{1, 1, 1, 1});
}

TEST_CASE("ops: comparisons, where and masked_fill") {
  for (const auto& [sa, sb] : kBroadcastShapes) {
    run_op_case({.name = "lt/ge/eq", .inputs = {{sa}, {sb}},
                 .op = [](const V& x) { return V{lt(x[0], x[1]), ge(x[0], x[1]), eq(x[0], x[0])}; },
                 .ref = [](const R& r) {
                   return R{zip(r[0], r[1], [](double a, double b) { return double(a < b); }),
                            zip(r[0], r[1], [](double a, double b) { return double(a >= b); }),
                            zip(r[0], r[0], [](double a, double b) { return double(a == b); })};
                 },
                 .lowp = false});
    run_op_case({.name = "where", .inputs = {{sa, Gen::mask}, {sa}, {sb}},
                 .op = [](const V& x) { return V{where(x[0], x[1], x[2])}; },
                 .ref = [](const R& r) {
                   Ref ab = zip(r[1], r[2], [](double a, double) { return a; });
                   Ref ba = zip(r[1], r[2], [](double, double b) { return b; });
                   Ref m = zip(r[0], ab, [](double c, double) { return c; });
                   Ref out(ab.shape);
                   for (int64_t i = 0; i < out.numel(); ++i) out[i] = m[i] != 0 ? ab[i] : ba[i];
                   return R{out};
                 }});
  }
  run_op_case({.name = "masked_fill", .inputs = {{{4, 5}}, {{1, 5}, Gen::mask}},
               .op = [](const V& x) { return V{masked_fill(x[0], x[1], -3.0)}; },
               .ref = [](const R& r) { return R{zip(r[0], r[1], [](double a, double m) { return m != 0 ? -3.0 : a; })}; }});
}

// bf16 runs are summed in sixteen lanes with four accumulators and a tail: rows of 1,000 (lanes,
// 16-steps and a tail of 8) and one run of 200,003 (the fixed chunks of a long reduction). The
// results are bf16, so they are checked to within two of its rounding steps.
TEST_CASE("ops: bf16 sums and sums of squares over long rows and runs match the f64 sum of the same values") {
  for (const Shape& s : {Shape{5, 1000}, Shape{200003}}) {
    const Tensor x = randn(s, RngKey(11, "bf16 sums")).to(DType::bf16);
    const std::vector<double> v = x.to_vector();
    const int64_t cols = s.back(), rows = int64_t(v.size()) / cols;
    const std::vector<double> got = sum(x, {int64_t(s.size()) - 1}).to_vector();
    REQUIRE(got.size() == size_t(rows));
    double want_sq = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double want = 0;
      for (int64_t c = 0; c < cols; ++c) want += v[size_t(r * cols + c)];
      CAPTURE(r);
      CHECK(std::abs(got[size_t(r)] - want) <= std::abs(want) / 256 + 1e-4 * std::sqrt(double(cols)));
    }
    for (double a : v) want_sq += a * a;
    const double got_sq = sum_squares(x).to_vector()[0];
    CHECK(std::abs(got_sq - want_sq) <= want_sq / 256);
  }
}

// where on long contiguous runs takes each element's bits from a or b by a mask of the condition's
// byte (a vectorised loop, then its scalar tail), in every dtype, with either side a broadcast
// scalar (masked_fill), and on strided views.
TEST_CASE("ops: where picks a's or b's element for every element of long runs, in every dtype") {
  const int64_t n = 1003;
  const Tensor cond = gt(randn({n}, RngKey(5, "where cond")), scalar_tensor(0.0));
  const std::vector<double> cv = cond.to_vector();
  std::vector<double> av(static_cast<size_t>(n)), bv(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    av[size_t(i)] = double(i % 97) - 40.0;
    bv[size_t(i)] = 1000.0 + double(i % 89);
  }
  av[3] = -0.0;
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64}) {
    const Tensor a = from_vector(av, {n}, {.dtype = dt}), b = from_vector(bv, {n}, {.dtype = dt});
    const std::vector<double> ad = a.to_vector(), bd = b.to_vector();  // (as the dtype holds them)
    const std::vector<double> got = where(cond, a, b).to_vector();
    const std::vector<double> got_bcast = where(cond, a, scalar_like(7.0, a)).to_vector();
    const std::vector<double> got_fill = masked_fill(b, cond, -3.0).to_vector();  // (a scalar a)
    const std::vector<double> got_strided = where(cond.slice(0, 0, n, 2), a.slice(0, 0, n, 2), b.slice(0, 0, n, 2)).to_vector();
    int64_t wrong = 0, wrong_bcast = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool c = cv[size_t(i)] != 0;
      wrong += got[size_t(i)] != (c ? ad[size_t(i)] : bd[size_t(i)]);
      wrong_bcast += got_bcast[size_t(i)] != (c ? ad[size_t(i)] : 7.0);
      wrong_bcast += got_fill[size_t(i)] != (c ? -3.0 : bd[size_t(i)]);
      if (i % 2 == 0) wrong_bcast += got_strided[size_t(i / 2)] != (c ? ad[size_t(i)] : bd[size_t(i)]);
    }
    const std::string name = dtype_name(dt);
    CAPTURE(name);
    CHECK(wrong == 0);
    CHECK(wrong_bcast == 0);
    if (dt == DType::f32 || dt == DType::f64) CHECK(std::signbit(where(ones({1}, {.dtype = DType::b8}), a.slice(0, 3, 4), b.slice(0, 3, 4)).to_vector()[0]));
  }
}

TEST_CASE("ops: sum, mean, max and min over dims, all dims and keepdim") {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{17}, {}}, {{4, 6}, {1}}, {{4, 6}, {0}}, {{3, 4, 5}, {0, 2}}, {{3, 4, 5}, {-1}}, {{2, 3, 4}, {}}, {{0, 3}, {0}}, {{}, {}}};
  for (const auto& entry : cases) {  // no structured binding: clang 14 cannot capture one
    const auto& shape = entry.first;
    const auto& dims = entry.second;
    for (bool keep : {false, true}) {
      run_op_case({.name = "sum", .inputs = {{shape}},
                   .op = [&](const V& x) { return V{sum(x[0], dims, keep)}; },
                   .ref = [&](const R& r) { return R{reduce(r[0], dims, keep, 0.0, [](double a, double b) { return a + b; })}; },
                   .lowp_tol = 4e-2});
      const int64_t count = [&] {
        Ref probe(shape);
        return probe.numel() / std::max<int64_t>(1, reduce(probe, dims, keep, 0, [](double a, double) { return a; }).numel());
      }();
      if (numel_of(shape) == 0) continue;
      run_op_case({.name = "mean", .inputs = {{shape}},
                   .op = [&](const V& x) { return V{mean(x[0], dims, keep)}; },
                   .ref = [&](const R& r) {
                     return R{map(reduce(r[0], dims, keep, 0.0, [](double a, double b) { return a + b; }),
                                  [&](double s) { return s / double(count); })};
                   }});
      run_op_case({.name = "max", .inputs = {{shape, Gen::distinct}},
                   .op = [&](const V& x) { return V{max(x[0], dims, keep), min(x[0], dims, keep)}; },
                   .ref = [&](const R& r) {
                     return R{reduce(r[0], dims, keep, -INFINITY, [](double a, double b) { return std::max(a, b); }),
                              reduce(r[0], dims, keep, INFINITY, [](double a, double b) { return std::min(a, b); })};
                   }});
    }
  }
}

TEST_CASE("ops: max splits the gradient evenly between ties") {
  Tensor x = from_vector({1, 3, 3, 2}, {4}, {.dtype = DType::f64, .requires_grad = true});
  max(x).backward();
  CHECK(x.grad().to_vector() == std::vector<double>{0, 0.5, 0.5, 0});
}

TEST_CASE("ops: argmax picks the first maximum along a dim and over all") {
  run_op_case({.name = "argmax", .inputs = {{{5, 7}}},
               .op = [](const V& x) { return V{argmax(x[0], 1), argmax(x[0], 0, true), argmax(x[0])}; },
               .ref = [](const R& r) {
                 const Ref& a = r[0];
                 Ref r1({5}), r0({1, 7}), all(Shape{});
                 for (int64_t i = 0; i < 5; ++i) {
                   int64_t best = 0;
                   for (int64_t j = 1; j < 7; ++j) if (a.at({i, j}) > a.at({i, best})) best = j;
                   r1[i] = double(best);
                 }
                 for (int64_t j = 0; j < 7; ++j) {
                   int64_t best = 0;
                   for (int64_t i = 1; i < 5; ++i) if (a.at({i, j}) > a.at({best, j})) best = i;
                   r0[j] = double(best);
                 }
                 int64_t b = 0;
                 for (int64_t i = 1; i < a.numel(); ++i) if (a[i] > a[b]) b = i;
                 all[0] = double(b);
                 return R{r1, r0, all};
               },
               .lowp = false});
  Tensor t = from_vector({1, 5, 5, 0}, {4});
  CHECK(argmax(t).item<int64_t>() == 1);
}

TEST_CASE("ops: matmul covers vectors, matrices, batches and broadcast batch dims") {
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{5}, {5}}, {{3, 5}, {5}}, {{5}, {5, 4}}, {{3, 5}, {5, 4}}, {{2, 3, 5}, {5, 4}}, {{2, 3, 5}, {2, 5, 4}},
      {{2, 1, 3, 5}, {4, 5, 2}}, {{1, 3, 5}, {3, 5, 2}}, {{0, 5}, {5, 3}}, {{3, 0}, {0, 2}}, {{17, 33}, {33, 9}}};
  for (const auto& [sa, sb] : cases) {
    run_op_case({.name = "matmul", .inputs = {{sa}, {sb}},
                 .op = [](const V& x) { return V{matmul(x[0], x[1])}; },
                 .ref = [](const R& r) { return R{matmul(r[0], r[1])}; },
                 .lowp_tol = 4e-2, .f32_tol = 1e-5});
  }
  run_op_case({.name = "linear", .inputs = {{{2, 3, 6}}, {{4, 6}}, {{4}}},
               .op = [](const V& x) { return V{linear(x[0], x[1], x[2])}; },
               .ref = [](const R& r) {
                 return R{zip(matmul(r[0], permute(r[1], {1, 0})), r[2], [](double a, double b) { return a + b; })};
               },
               .lowp_tol = 4e-2});
}

TEST_CASE("ops: views and copies carry gradients back through the view") {
  run_op_case({.name = "permute+reshape", .inputs = {{{2, 3, 4}}},
               .op = [](const V& x) { return V{x[0].permute({2, 0, 1}).reshape({4, 6}) * 2.0}; },
               .ref = [](const R& r) {
                 Ref p = permute(r[0], {2, 0, 1});
                 p.shape = {4, 6};
                 return R{map(p, [](double a) { return 2 * a; })};
               }});
  run_op_case({.name = "slice+select", .inputs = {{{5, 6}}},
               .op = [](const V& x) { return V{x[0].slice(1, 1, 6, 2), x[0].select(0, 3), x[0].narrow(0, 1, 2)}; },
               .ref = [](const R& r) {
                 const Ref& a = r[0];
                 Ref s({5, 3}), sel({6}), nar({2, 6});
                 for (int64_t i = 0; i < 5; ++i)
                   for (int64_t j = 0; j < 3; ++j) s.at({i, j}) = a.at({i, 1 + 2 * j});
                 for (int64_t j = 0; j < 6; ++j) sel[j] = a.at({3, j});
                 for (int64_t i = 0; i < 2; ++i)
                   for (int64_t j = 0; j < 6; ++j) nar.at({i, j}) = a.at({i + 1, j});
                 return R{s, sel, nar};
               }});
  run_op_case({.name = "expand+unsqueeze+flatten", .inputs = {{{3, 1}}},
               .op = [](const V& x) { return V{x[0].expand({2, 3, 4}).flatten(1), x[0].squeeze(1).unsqueeze(0)}; },
               .ref = [](const R& r) {
                 Ref e({2, 12});
                 for (int64_t b = 0; b < 2; ++b)
                   for (int64_t i = 0; i < 3; ++i)
                     for (int64_t j = 0; j < 4; ++j) e.at({b, i * 4 + j}) = r[0][i];
                 Ref u({1, 3}, r[0].v);
                 return R{e, u};
               }});
  run_op_case({.name = "cast round trip", .inputs = {{{4, 3}}},
               .op = [](const V& x) { return V{x[0].to(DType::f32).to(x[0].dtype()) * 1.0}; },
               .ref = [](const R& r) { return R{map(r[0], [](double a) { return double(float(a)); })}; },
               .gradcheck = false});  // the f32 rounding makes finite differences meaningless
  Tensor x = from_vector({1.5, -2}, {2}, {.dtype = DType::f64, .requires_grad = true});
  sum(x.to(DType::bf16) * 3.0).backward();
  CHECK(x.grad().dtype() == DType::f64);
  CHECK(x.grad().to_vector() == std::vector<double>{3, 3});
}

TEST_CASE("ops: long reductions are accurate and independent of the thread count") {
  Tensor x = randn({300007}, RngKey(test_seed(), "long"));
  double want = 0, want_sq = 0, want_max = -INFINITY;
  for (double v : x.to_vector()) {
    want += v;
    want_sq += v * v;
    want_max = std::max(want_max, v);
  }
  const double s = sum(x).item<double>();
  CHECK(s == doctest::Approx(want).epsilon(1e-4).scale(std::sqrt(300007.0)));
  CHECK(sum_squares(x).item<double>() == doctest::Approx(want_sq).epsilon(1e-5));
  CHECK(max(x).item<double>() == want_max);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const double s1 = sum(x).item<double>();
  omp_set_num_threads(std::max(2, threads));
  const double s2 = sum(x).item<double>();
  omp_set_num_threads(threads);
  CHECK(s1 == s2);  // bit for bit
  CHECK(s2 == s);
}
