// Neural-network ops (engine/ops/nn.h) through the op harness against naive float64 loop
// references, plus their documented semantics (ignored targets, fully masked attention rows,
// dropout masks) and error paths.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/nn.h"
#include "kernels/philox.h"
#include "op_harness.h"

using namespace quilt;
using namespace quilt::test;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

int64_t wrap(int64_t dim, int64_t ndim) { return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim; }

// Element of `r` at the multi-index `idx` of a larger shape `r` broadcasts to (trailing alignment).
double bcast(const Ref& r, const Shape& idx) {
  Shape p(r.shape.size());
  const size_t lead = idx.size() - r.shape.size();
  for (size_t d = 0; d < r.shape.size(); ++d) p[d] = r.shape[d] == 1 ? 0 : idx[lead + d];
  return r.at(p);
}

// Calls f(offsets) for every 1-D line of `shape` along `dim` (offsets into the row-major data).
template <class F>
void for_each_line(const Shape& shape, int64_t dim, F&& f) {
  const int64_t len = shape[size_t(dim)];
  if (len == 0) return;
  const int64_t stride = contiguous_strides(shape)[size_t(dim)];
  for (int64_t i = 0; i < numel_of(shape); ++i) {
    if (unravel(i, shape)[size_t(dim)] != 0) continue;
    std::vector<int64_t> offs(static_cast<size_t>(len));
    for (int64_t k = 0; k < len; ++k) offs[size_t(k)] = i + k * stride;
    f(offs);
  }
}

// ---- naive float64 references ----

Ref softmax_ref(const Ref& x, int64_t dim, bool log) {
  Ref out(x.shape);
  if (x.dim() == 0) {
    out[0] = log ? 0.0 : 1.0;
    return out;
  }
  for_each_line(x.shape, wrap(dim, x.dim()), [&](const std::vector<int64_t>& o) {
    double m = -kInf, s = 0;
    for (int64_t i : o) m = std::max(m, x[i]);
    for (int64_t i : o) s += std::exp(x[i] - m);
    for (int64_t i : o) out[i] = log ? x[i] - m - std::log(s) : std::exp(x[i] - m) / s;
  });
  return out;
}

// Per-target losses (shape of target) and how many were counted.
Ref cross_entropy_rows_ref(const Ref& logits, const Ref& target, int64_t ignore, int64_t* counted) {
  const int64_t c = logits.shape.back();
  Ref out(target.shape);
  *counted = 0;
  for (int64_t r = 0; r < target.numel(); ++r) {
    const int64_t t = int64_t(target[r]);
    if (t == ignore) continue;
    ++*counted;
    double m = -kInf, s = 0;
    for (int64_t j = 0; j < c; ++j) m = std::max(m, logits[r * c + j]);
    for (int64_t j = 0; j < c; ++j) s += std::exp(logits[r * c + j] - m);
    out[r] = m + std::log(s) - logits[r * c + t];
  }
  return out;
}

Ref cross_entropy_ref(const Ref& logits, const Ref& target, int64_t ignore, Reduction red) {
  int64_t counted = 0;
  Ref rows = cross_entropy_rows_ref(logits, target, ignore, &counted);
  if (red == Reduction::none) return rows;
  double s = 0;
  for (double v : rows.v) s += v;
  return Ref(Shape{}, {red == Reduction::sum ? s : s / double(counted)});
}

Ref embedding_ref(const Ref& w, const Ref& idx) {
  const int64_t d = w.shape[1];
  Shape s = idx.shape;
  s.push_back(d);
  Ref out(s);
  for (int64_t i = 0; i < idx.numel(); ++i)
    for (int64_t j = 0; j < d; ++j) out[i * d + j] = w[int64_t(idx[i]) * d + j];
  return out;
}

Ref rms_norm_ref(const Ref& x, const Ref* w, double eps) {
  Ref out(x.shape);
  for_each_line(x.shape, x.dim() - 1, [&](const std::vector<int64_t>& o) {
    double ss = 0;
    for (int64_t i : o) ss += x[i] * x[i];
    const double r = 1 / std::sqrt(ss / double(o.size()) + eps);
    for (size_t j = 0; j < o.size(); ++j) out[o[j]] = x[o[j]] * r * (w ? (*w)[int64_t(j)] : 1.0);
  });
  return out;
}

Ref layer_norm_ref(const Ref& x, const Ref* w, const Ref* b, double eps) {
  Ref out(x.shape);
  for_each_line(x.shape, x.dim() - 1, [&](const std::vector<int64_t>& o) {
    double mu = 0, var = 0;
    for (int64_t i : o) mu += x[i];
    mu /= double(o.size());
    for (int64_t i : o) var += (x[i] - mu) * (x[i] - mu);
    var /= double(o.size());
    for (size_t j = 0; j < o.size(); ++j)
      out[o[j]] = (x[o[j]] - mu) / std::sqrt(var + eps) * (w ? (*w)[int64_t(j)] : 1.0) + (b ? (*b)[int64_t(j)] : 0.0);
  });
  return out;
}

Ref rotary_ref(const Ref& x, const Ref& cos, const Ref& sin) {
  const int64_t d = x.shape.back(), h = d / 2;
  Ref out(x.shape);
  for (int64_t e = 0; e < x.numel(); ++e) {
    Shape idx = unravel(e, x.shape);
    const int64_t i = idx.back();
    Shape t = idx;
    t.back() = i % h;
    const double c = bcast(cos, t), s = bcast(sin, t);
    const double partner = i < h ? -x[e + h] : x[e - h];
    out[e] = x[e] * c + partner * s;
  }
  return out;
}

// Attention with loops; `mask` may be null; rows that attend nothing give zeros.
Ref sdpa_ref(const Ref& q, const Ref& k, const Ref& v, const Ref* mask, bool causal, double scale) {
  const int64_t b = q.shape[0], hq = q.shape[1], t = q.shape[2], d = q.shape[3];
  const int64_t hkv = k.shape[1], s = k.shape[2], dv = v.shape[3];
  Ref out({b, hq, t, dv});
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kh = h / (hq / hkv);
      for (int64_t i = 0; i < t; ++i) {
        std::vector<double> sc(static_cast<size_t>(s));
        std::vector<bool> ok(static_cast<size_t>(s));
        double m = -kInf;
        for (int64_t j = 0; j < s; ++j) {
          double acc = 0;
          for (int64_t c = 0; c < d; ++c) acc += q.at({bi, h, i, c}) * k.at({bi, kh, j, c});
          sc[size_t(j)] = acc * scale;
          ok[size_t(j)] = (!mask || bcast(*mask, {bi, h, i, j}) != 0) && (!causal || j <= i + s - t);
          if (ok[size_t(j)]) m = std::max(m, sc[size_t(j)]);
        }
        if (m == -kInf) continue;  // attends nothing: zeros
        double z = 0;
        for (int64_t j = 0; j < s; ++j) z += ok[size_t(j)] ? std::exp(sc[size_t(j)] - m) : 0.0;
        for (int64_t j = 0; j < s; ++j) {
          if (!ok[size_t(j)]) continue;
          const double p = std::exp(sc[size_t(j)] - m) / z;
          for (int64_t c = 0; c < dv; ++c) out.at({bi, h, i, c}) += p * v.at({bi, kh, j, c});
        }
      }
    }
  return out;
}

// Whether dropout keeps element i under (seed, key): the definition from kernels/philox.h.
bool philox_keeps(uint64_t seed, uint64_t key, int64_t i, double p) {
  return double(kernels::uint_to_unit(kernels::philox_block(seed, key, uint64_t(i)).v[0])) > p;
}

// Constant bool tensor of `shape` on `device` whose element i is pred(i).
template <class P>
Tensor bool_tensor(const Shape& shape, P&& pred, Device device = Device::cpu()) {
  std::vector<double> v(static_cast<size_t>(numel_of(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = pred(int64_t(i)) ? 1.0 : 0.0;
  return from_vector(v, shape, {.dtype = DType::b8, .device = device});
}

const char* reduction_name(Reduction r) {
  return r == Reduction::mean ? "mean" : r == Reduction::sum ? "sum" : "none";
}

}  // namespace

TEST_CASE("nn ops: softmax and log_softmax match the float64 reference along every dim") {
  const std::vector<std::pair<Shape, int64_t>> cases = {
      {{13}, 0}, {{3, 7}, -1}, {{3, 7}, 0}, {{2, 3, 5}, 1}, {{2, 3, 33}, -1}, {{0, 4}, -1}, {{4, 0}, 0}, {{}, 0}};
  for (const auto& [shape, dim] : cases) {
    for (bool log : {false, true}) {
      run_op_case({.name = std::string(log ? "log_softmax" : "softmax") + " dim " + std::to_string(dim),
                   .inputs = {{shape}},
                   .op = [dim = dim, log](const V& x) { return V{log ? log_softmax(x[0], dim) : softmax(x[0], dim)}; },
                   .ref = [dim = dim, log](const R& r) { return R{softmax_ref(r[0], dim, log)}; }});
    }
  }
}

TEST_CASE("nn ops: softmax subtracts the row max, so huge logits stay finite in every dtype") {
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    CAPTURE(dtype_name(dt));
    const double base = dt == DType::f16 ? 60000.0 : 1e4;  // near the top of f16's range
    Tensor x = from_vector({base, base + 1.0 * (dt == DType::f16 ? 32 : 1), base}, {1, 3}, {.dtype = dt});
    const std::vector<double> xs = x.to_vector();
    const Ref want = softmax_ref(Ref({1, 3}, xs), -1, false);
    const std::vector<double> got = softmax(x).to_vector();
    const std::vector<double> lgot = log_softmax(x).to_vector();
    const Ref lwant = softmax_ref(Ref({1, 3}, xs), -1, true);
    for (size_t i = 0; i < 3; ++i) {
      CHECK(std::isfinite(got[i]));
      CHECK(got[i] == doctest::Approx(want[int64_t(i)]).epsilon(1e-2));
      CHECK(lgot[i] == doctest::Approx(lwant[int64_t(i)]).epsilon(1e-2));
    }
  }
}

TEST_CASE("nn ops: softmax of large inputs runs rows in parallel and matches the reference") {
  run_op_case({.name = "softmax 300x513", .inputs = {{{300, 513}}},
               .op = [](const V& x) { return V{softmax(x[0], -1), log_softmax(x[0], 0)}; },
               .ref = [](const R& r) { return R{softmax_ref(r[0], -1, false), softmax_ref(r[0], 0, true)}; },
               .gradcheck = false});
}

TEST_CASE("nn ops: cross_entropy matches the reference for every reduction, with ignored targets") {
  const int64_t ignore = -100;
  // (Rows of 33 and 150 classes take the CPU's sixteen-lane steps: 64-element steps, then 16,
  // then a scalar tail.)
  const std::vector<std::pair<Shape, int64_t>> cases = {{{7}, 5}, {{1}, 33}, {{0}, 4}, {{2, 3}, 6}, {{5}, 1},
                                                        {{3}, 150}};
  for (const auto& [lead, c] : cases) {
    Shape ls = lead;
    ls.push_back(c);
    // Every third target from the second one on is ignored, so row 0 always counts. (Moved to
    // the inputs' device in the op, so the harness's GPU pass runs the case too.)
    const Tensor ignored = bool_tensor(lead, [](int64_t i) { return i % 3 == 1; });
    for (DType tdt : {DType::i64, DType::i32}) {
      for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
        run_op_case({.name = std::string("cross_entropy ") + reduction_name(red) + " " + dtype_name(tdt),
                     .inputs = {{ls}, {lead, Gen::index, false, c, tdt}},
                     .op = [=](const V& x) {
                       Tensor t = where(ignored.to(x[1].device()), scalar_like(double(ignore), x[1]), x[1]);
                       return V{cross_entropy(x[0], t, ignore, red)};
                     },
                     .ref = [=](const R& r) {
                       Ref t = r[1];
                       for (int64_t i = 0; i < t.numel(); ++i)
                         if (i % 3 == 1) t[i] = double(ignore);
                       return R{cross_entropy_ref(r[0], t, ignore, red)};
                     }});
      }
    }
  }
}

TEST_CASE("nn ops: cross_entropy with every target ignored: mean is NaN, sum is 0, gradients are 0") {
  Tensor logits = randn({3, 4}, RngKey(1, "ce"), {.dtype = DType::f32, .requires_grad = true});
  Tensor target = from_vector({7, 7, 7}, {3}, {.dtype = DType::i64});
  CHECK(std::isnan(cross_entropy(logits, target, 7, Reduction::mean).item<double>()));
  Tensor s = cross_entropy(logits, target, 7, Reduction::sum);
  CHECK(s.item<double>() == 0.0);
  cross_entropy(logits, target, 7, Reduction::mean).backward();
  for (double g : logits.grad().to_vector()) CHECK(g == 0.0);
  // No rows at all: the mean of nothing is NaN too, the sum 0.
  Tensor empty_logits = zeros({0, 4});
  Tensor empty_target = zeros({0}, {.dtype = DType::i64});
  CHECK(std::isnan(cross_entropy(empty_logits, empty_target).item<double>()));
  CHECK(cross_entropy(empty_logits, empty_target, -100, Reduction::sum).item<double>() == 0.0);
}

TEST_CASE("nn ops: cross_entropy keeps f32 accuracy for bf16 logits and returns their dtype") {
  Tensor logits = randn({64, 1000}, RngKey(2, "ce"), {.dtype = DType::f32}, 0, 3).to(DType::bf16);
  Tensor target = randint(0, 1000, {64}, RngKey(2, "t"));
  Tensor got = cross_entropy(logits, target);
  CHECK(got.dtype() == DType::bf16);
  int64_t counted = 0;
  Ref rows = cross_entropy_rows_ref(Ref::of(logits), Ref::of(target), -100, &counted);
  double want = 0;
  for (double v : rows.v) want += v;
  want /= double(counted);
  // One bf16 rounding of the result, not of every per-row loss and partial sum.
  CHECK(got.item<double>() == doctest::Approx(want).epsilon(4e-3));
}

TEST_CASE("nn ops: cross_entropy stays finite for huge logits and gives -inf logits zero gradient") {
  // Row 0 sits at 1e4 (exp overflows without the max subtracted); row 1 masks every class but
  // three with -inf, in f32 and bf16, in rows long enough for every lane step.
  const int64_t c = 150;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> v(size_t(2 * c));
  for (int64_t j = 0; j < c; ++j) {
    v[size_t(j)] = 1e4 + 0.01 * double(j % 7);
    v[size_t(c + j)] = (j == 3 || j == 70 || j == 149) ? 0.5 * double(j % 5) : -inf;
  }
  for (const DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    Tensor x = from_vector(v, {2, c}).to(dt).set_requires_grad();
    Tensor t = from_vector({4, 70}, {2}, {.dtype = DType::i64});
    Tensor loss = cross_entropy(x, t, -100, Reduction::none);
    const std::vector<double> xs = x.detach().to(DType::f64).to_vector();
    for (int64_t r = 0; r < 2; ++r) {
      double m = -inf, s = 0;
      for (int64_t j = 0; j < c; ++j) m = std::max(m, xs[size_t(r * c + j)]);
      for (int64_t j = 0; j < c; ++j) s += std::exp(xs[size_t(r * c + j)] - m);
      const double want = m + std::log(s) - xs[size_t(r * c + (r == 0 ? 4 : 70))];
      // (row 0's loss is lse - x_t, both near 1e4: f32 keeps it to ~1e-3, a bf16 result to 2^-5 of 5)
      CHECK(std::abs(loss.to(DType::f64).to_vector()[size_t(r)] - want) < (dt == DType::bf16 ? 4e-2 : 4e-3));
    }
    loss.sum().backward();
    const std::vector<double> gx = x.grad().to(DType::f64).to_vector();
    for (int64_t j = 0; j < c; ++j) {
      // (0 where exp flushes results below f32's normal range, as the lane kernels do; a denormal
      // with Eigen's array exp elsewhere)
      if (std::isinf(v[size_t(c + j)])) CHECK(std::abs(gx[size_t(c + j)]) < 1e-37);
      CHECK(std::isfinite(gx[size_t(j)]));
    }
  }
}

TEST_CASE("nn ops: cross_entropy errors name the shapes and the first bad target") {
  Tensor logits = randn({4, 5}, RngKey(3, "ce"));
  CHECK_THROWS_WITH_AS(cross_entropy(logits, zeros({3}, {.dtype = DType::i64})),
                       doctest::Contains("[cross_entropy] target of shape (3,) does not match logits of shape (4, 5)"),
                       Error);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, from_vector({0, 7, 2, 9}, {4}, {.dtype = DType::i64})),
                       doctest::Contains("[cross_entropy] target 7 at row 1 is out of range for 5 classes"), Error);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, from_vector({0, 1, -1, 2}, {4}, {.dtype = DType::i32})),
                       doctest::Contains("[cross_entropy] target -1 at row 2 is out of range"), Error);
  CHECK_THROWS_WITH_AS(cross_entropy(logits, zeros({4})),
                       doctest::Contains("[cross_entropy] target must hold class indices"), Error);
  CHECK_THROWS_WITH_AS(cross_entropy(zeros({4, 5}, {.dtype = DType::i64}), zeros({4}, {.dtype = DType::i64})),
                       doctest::Contains("[cross_entropy] logits must be floating"), Error);
  // The ignore value itself is always accepted, even outside [0, C).
  CHECK_NOTHROW(cross_entropy(logits, from_vector({0, -5, 4, -5}, {4}, {.dtype = DType::i64}), -5));
}

TEST_CASE("nn ops: embedding gathers rows and sums duplicate gradients") {
  const std::vector<std::tuple<Shape, int64_t, int64_t>> cases = {
      {{2, 5}, 7, 3}, {{13}, 4, 17}, {{0}, 3, 2}, {{3, 1, 4}, 2, 5}, {{}, 6, 4}};
  for (const auto& [ishape, vocab, dim] : cases) {
    for (DType idt : {DType::i64, DType::i32}) {
      run_op_case({.name = std::string("embedding ") + dtype_name(idt),
                   .inputs = {{{vocab, dim}}, {ishape, Gen::index, false, vocab, idt}},
                   .op = [](const V& x) { return V{embedding(x[0], x[1])}; },
                   .ref = [](const R& r) { return R{embedding_ref(r[0], r[1])}; }});
    }
  }
  // Every index the same: the weight row's gradient is the sum of all rows of g, other rows 0.
  Tensor w = randn({5, 3}, RngKey(4, "w"), {.dtype = DType::f64, .requires_grad = true});
  Tensor idx = full({200}, 2, {.dtype = DType::i64});
  Tensor g = randn({200, 3}, RngKey(4, "g"), {.dtype = DType::f64});
  embedding(w, idx).backward(g);
  const Ref gw = Ref::of(w.grad()), gr = Ref::of(g);
  for (int64_t v = 0; v < 5; ++v)
    for (int64_t j = 0; j < 3; ++j) {
      double want = 0;
      if (v == 2)
        for (int64_t i = 0; i < 200; ++i) want += gr[i * 3 + j];
      CHECK(gw[v * 3 + j] == doctest::Approx(want).epsilon(1e-12));
    }
}

TEST_CASE("nn ops: embedding rejects indices outside the vocabulary, naming index and size") {
  Tensor w = randn({5, 3}, RngKey(5, "w"));
  CHECK_THROWS_WITH_AS(embedding(w, from_vector({1, 4, 7}, {3}, {.dtype = DType::i64})),
                       doctest::Contains("[embedding] index 7 at position 2 is out of range for a vocabulary of "
                                         "5 rows"),
                       Error);
  CHECK_THROWS_WITH_AS(embedding(w, from_vector({-1}, {1}, {.dtype = DType::i32})),
                       doctest::Contains("[embedding] index -1 at position 0"), Error);
  CHECK_THROWS_WITH_AS(embedding(w, zeros({2})), doctest::Contains("[embedding] indices must be i32 or i64, got f32"),
                       Error);
  CHECK_THROWS_WITH_AS(embedding(randn({5}, RngKey(5, "v")), zeros({2}, {.dtype = DType::i64})),
                       doctest::Contains("[embedding] weight must be (V, D), got shape (5,)"), Error);
}

TEST_CASE("nn ops: rms_norm matches the reference with and without weight") {
  const std::vector<Shape> shapes = {{3, 7}, {2, 3, 33}, {1}, {0, 8}, {4, 1}, {5, 150}};
  for (const Shape& s : shapes) {
    const double eps = 1e-6;
    run_op_case({.name = "rms_norm", .inputs = {{s}, {{s.back()}}},
                 .op = [eps](const V& x) { return V{rms_norm(x[0], x[1], eps)}; },
                 .ref = [eps](const R& r) { return R{rms_norm_ref(r[0], &r[1], eps)}; }});
    run_op_case({.name = "rms_norm without weight", .inputs = {{s}},
                 .op = [](const V& x) { return V{rms_norm(x[0], Tensor(), 1e-3)}; },
                 .ref = [](const R& r) { return R{rms_norm_ref(r[0], nullptr, 1e-3)}; }});
  }
}

TEST_CASE("nn ops: layer_norm matches the reference with weight and bias, weight only, and neither") {
  const std::vector<Shape> shapes = {{3, 7}, {2, 3, 33}, {0, 5}, {4, 2}};
  for (const Shape& s : shapes) {
    const int64_t d = s.back();
    run_op_case({.name = "layer_norm", .inputs = {{s}, {{d}}, {{d}}},
                 .op = [](const V& x) { return V{layer_norm(x[0], x[1], x[2])}; },
                 .ref = [](const R& r) { return R{layer_norm_ref(r[0], &r[1], &r[2], 1e-5)}; }});
    run_op_case({.name = "layer_norm weight only", .inputs = {{s}, {{d}}},
                 .op = [](const V& x) { return V{layer_norm(x[0], x[1], Tensor(), 1e-3)}; },
                 .ref = [](const R& r) { return R{layer_norm_ref(r[0], &r[1], nullptr, 1e-3)}; }});
    run_op_case({.name = "layer_norm bias only", .inputs = {{s}, {{d}}},
                 .op = [](const V& x) { return V{layer_norm(x[0], Tensor(), x[1])}; },
                 .ref = [](const R& r) { return R{layer_norm_ref(r[0], nullptr, &r[1], 1e-5)}; }});
  }
}

TEST_CASE("nn ops: norms of many rows split the work and sum weight gradients over every row") {
  run_op_case({.name = "rms_norm 700x96", .inputs = {{{700, 96}}, {{96}}},
               .op = [](const V& x) { return V{rms_norm(x[0], x[1])}; },
               .ref = [](const R& r) { return R{rms_norm_ref(r[0], &r[1], 1e-6)}; },
               .gradcheck = false});
  // Weight gradients of a large input against the loop reference (sum over rows of g * xhat).
  Tensor x = randn({700, 96}, RngKey(6, "x"), {.dtype = DType::f64});
  Tensor w = randn({96}, RngKey(6, "w"), {.dtype = DType::f64, .requires_grad = true});
  Tensor b = randn({96}, RngKey(6, "b"), {.dtype = DType::f64, .requires_grad = true});
  Tensor g = randn({700, 96}, RngKey(6, "g"), {.dtype = DType::f64});
  layer_norm(x, w, b).backward(g);
  const Ref xr = Ref::of(x), gr = Ref::of(g);
  const Ref xhat = layer_norm_ref(xr, nullptr, nullptr, 1e-5);
  const Ref gw = Ref::of(w.grad()), gb = Ref::of(b.grad());
  for (int64_t j = 0; j < 96; ++j) {
    double sw = 0, sb = 0;
    for (int64_t i = 0; i < 700; ++i) {
      sw += gr[i * 96 + j] * xhat[i * 96 + j];
      sb += gr[i * 96 + j];
    }
    CHECK(gw[j] == doctest::Approx(sw).epsilon(1e-10));
    CHECK(gb[j] == doctest::Approx(sb).epsilon(1e-10));
  }
}

TEST_CASE("nn ops: rms_norm weight gradients of rows wider than a partial-sum chunk") {
  // 130 rows x 1100 columns: every row block holds a partial row, summed in chunks of 512
  // columns with a ragged tail; f64 (the scalar path) and f32 (sixteen lanes) against a loop.
  constexpr int64_t rows = 130, cols = 1100;
  for (DType dt : {DType::f64, DType::f32}) {
    INFO(dtype_name(dt));
    Tensor x = randn({rows, cols}, RngKey(8, "x"), {.dtype = dt});
    Tensor w = randn({cols}, RngKey(8, "w"), {.dtype = dt, .requires_grad = true});
    Tensor g = randn({rows, cols}, RngKey(8, "g"), {.dtype = dt});
    rms_norm(x, w, 1e-6).backward(g);
    const std::vector<double> xv = x.to_vector(), gv = g.to_vector(), gw = w.grad().to_vector();
    std::vector<double> rstd(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) {
      double ss = 0;
      for (int64_t k = 0; k < cols; ++k) ss += xv[size_t(i * cols + k)] * xv[size_t(i * cols + k)];
      rstd[size_t(i)] = 1.0 / std::sqrt(ss / double(cols) + 1e-6);
    }
    const double tol = dt == DType::f64 ? 1e-10 : 1e-4;
    for (int64_t j = 0; j < cols; ++j) {
      double want = 0;
      for (int64_t i = 0; i < rows; ++i) want += gv[size_t(i * cols + j)] * xv[size_t(i * cols + j)] * rstd[size_t(i)];
      CHECK_MESSAGE(gw[size_t(j)] == doctest::Approx(want).epsilon(tol), "column ", j);
    }
  }
}

TEST_CASE("nn ops: norm errors name the mismatched shapes") {
  Tensor x = randn({2, 5}, RngKey(7, "x"));
  CHECK_THROWS_WITH_AS(rms_norm(x, ones({6})),
                       doctest::Contains("[rms_norm] weight of shape (6,) does not match the last dim of x (2, 5)"),
                       Error);
  CHECK_THROWS_WITH_AS(layer_norm(x, ones({5}), ones({2, 5})),
                       doctest::Contains("[layer_norm] bias of shape (2, 5) does not match the last dim of x (2, 5)"),
                       Error);
  CHECK_THROWS_WITH_AS(rms_norm(zeros({2, 5}, {.dtype = DType::i64}), Tensor()),
                       doctest::Contains("[rms_norm] needs a floating tensor, got i64"), Error);
  CHECK_THROWS_WITH_AS(layer_norm(scalar_tensor(1.0), Tensor(), Tensor()),
                       doctest::Contains("[layer_norm] needs at least 1 dim"), Error);
  CHECK_THROWS_WITH_AS(rms_norm(x, Tensor(), -1.0), doctest::Contains("[rms_norm] eps must be non-negative"), Error);
}

TEST_CASE("nn ops: rms_norm and layer_norm take f32 parameters with bf16 inputs") {
  Tensor x = randn({4, 16}, RngKey(8, "x")).to(DType::bf16);
  Tensor w = randn({16}, RngKey(8, "w"), {.requires_grad = true});
  Tensor y = rms_norm(x, w);
  CHECK(y.dtype() == DType::bf16);
  sum(y.to(DType::f32)).backward();
  CHECK(w.grad().dtype() == DType::f32);
  const Ref want = rms_norm_ref(Ref::of(x), nullptr, 1e-6);
  const Ref got = Ref::of(y), wr = Ref::of(w);
  for (int64_t i = 0; i < got.numel(); ++i)
    CHECK(got[i] == doctest::Approx(want[i] * double(BFloat16(float(wr[i % 16])))).epsilon(2e-2).scale(1));
}

TEST_CASE("nn ops: rotary_embedding rotates half-pairs like HF Llama's rotate_half") {
  // (B, H, T, D) with (T, D/2) tables; (B, T, H, D) with (T, 1, D/2) tables; odd sizes; empty T;
  // head dims of 40 and 64.
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{2, 3, 5, 8}, {5, 4}}, {{2, 5, 3, 6}, {5, 1, 3}}, {{7, 2}, {7, 1}}, {{1, 2, 0, 4}, {0, 2}}, {{3, 4}, {2}},
      {{1, 2, 3, 40}, {3, 20}}, {{1, 3, 2, 64}, {3, 1, 32}}};  // half 20 and 32: sixteen pairs at a time and a tail
  for (const auto& [xs, ts] : cases) {
    run_op_case({.name = "rotary_embedding", .inputs = {{xs}, {ts}, {ts}},
                 .op = [](const V& x) { return V{rotary_embedding(x[0], x[1], x[2])}; },
                 .ref = [](const R& r) { return R{rotary_ref(r[0], r[1], r[2])}; }});
  }
  // Real tables: a rotation keeps each pair's norm.
  const int64_t t = 6, d = 8;
  std::vector<double> c, s;
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < d / 2; ++j) {
      const double ang = double(i) * std::pow(10000.0, -2.0 * double(j) / double(d));
      c.push_back(std::cos(ang));
      s.push_back(std::sin(ang));
    }
  Tensor x = randn({1, 2, t, d}, RngKey(9, "x"), {.dtype = DType::f64});
  Tensor y = rotary_embedding(x, from_vector(c, {t, d / 2}), from_vector(s, {t, d / 2}));  // f32 tables cast to f64
  const Ref xr = Ref::of(x), yr = Ref::of(y);
  for (int64_t e = 0; e < xr.numel(); e += d)
    for (int64_t j = 0; j < d / 2; ++j) {
      const double nx = std::hypot(xr[e + j], xr[e + j + d / 2]), ny = std::hypot(yr[e + j], yr[e + j + d / 2]);
      CHECK(ny == doctest::Approx(nx).epsilon(1e-6));
    }
}

TEST_CASE("nn ops: rotary_embedding errors name the shapes") {
  CHECK_THROWS_WITH_AS(rotary_embedding(zeros({2, 3, 5}), zeros({3, 2}), zeros({3, 2})),
                       doctest::Contains("[rotary_embedding] the last dim of x must be even, got shape (2, 3, 5)"),
                       Error);
  CHECK_THROWS_WITH_AS(rotary_embedding(zeros({2, 3, 4}), zeros({4, 2}), zeros({4, 2})),
                       doctest::Contains("[rotary_embedding] tables of shape (4, 2) do not broadcast to (2, 3, 2)"),
                       Error);
  CHECK_THROWS_WITH_AS(rotary_embedding(zeros({2, 3, 4}), zeros({3, 2}), zeros({3, 1})),
                       doctest::Contains("[rotary_embedding] cos (3, 2) and sin (3, 1) differ in shape"), Error);
}

TEST_CASE("nn ops: scaled_dot_product_attention matches the reference: plain, causal, GQA, T != S") {
  struct Case {
    const char* name;
    Shape q, kv;
    int64_t dv;
    bool causal;
  };
  const Case cases[] = {
      {"plain", {2, 2, 5, 8}, {2, 2, 5, 8}, 8, false},
      {"causal", {1, 2, 5, 4}, {1, 2, 5, 4}, 4, true},
      {"causal GQA S > T", {1, 4, 3, 4}, {1, 2, 6, 4}, 3, true},   // query i sees keys j <= i + 3
      {"causal S < T", {2, 2, 6, 4}, {2, 1, 3, 4}, 5, true},       // queries 0..2 see nothing: zeros
      {"GQA no mask", {1, 6, 4, 5}, {1, 3, 7, 5}, 2, false},
      {"empty T", {1, 2, 0, 4}, {1, 2, 3, 4}, 4, true},
      {"empty S", {1, 2, 3, 4}, {1, 2, 0, 4}, 4, false},
  };
  for (const Case& c : cases) {
    Shape vs = c.kv;
    vs.back() = c.dv;
    const bool causal = c.causal;
    run_op_case({.name = std::string("sdpa ") + c.name, .inputs = {{c.q}, {c.kv}, {vs}},
                 .op = [causal](const V& x) { return V{scaled_dot_product_attention(x[0], x[1], x[2], {}, causal)}; },
                 .ref = [causal](const R& r) {
                   return R{sdpa_ref(r[0], r[1], r[2], nullptr, causal, 1 / std::sqrt(double(r[0].shape[3])))};
                 },
                 .lowp_tol = 4e-2});
  }
}

TEST_CASE("nn ops: scaled_dot_product_attention with a bool mask, a fully masked row and a custom scale") {
  // Mask (B, 1, T, S) broadcast over heads; query row 1 is masked out entirely.
  const int64_t t = 4, s = 5;
  const Tensor keep_rows = bool_tensor({t, 1}, [](int64_t i) { return i != 1; });
  for (bool causal : {false, true}) {
    run_op_case({.name = causal ? "sdpa mask + causal GQA" : "sdpa mask GQA",
                 .inputs = {{{2, 4, t, 2}}, {{2, 2, s, 2}}, {{2, 2, s, 3}}, {{2, 1, t, s}, Gen::mask}},
                 .op = [=](const V& x) {
                   const Tensor mask = logical_and(x[3], keep_rows.to(x[3].device()));
                   return V{scaled_dot_product_attention(x[0], x[1], x[2], mask, causal, 0.7)};
                 },
                 .ref = [=](const R& r) {
                   Ref m = r[3];
                   for (int64_t i = 0; i < m.numel(); ++i)
                     if (unravel(i, m.shape)[2] == 1) m[i] = 0;
                   return R{sdpa_ref(r[0], r[1], r[2], &m, causal, 0.7)};
                 },
                 .lowp_tol = 4e-2});
  }
  // The fully masked row is exactly zero, and so are the gradients flowing through it.
  Tensor q = randn({1, 1, 2, 3}, RngKey(10, "q"), {.requires_grad = true});
  Tensor k = randn({1, 1, 4, 3}, RngKey(10, "k"), {.requires_grad = true});
  Tensor v = randn({1, 1, 4, 3}, RngKey(10, "v"), {.requires_grad = true});
  Tensor mask = bool_tensor({2, 4}, [](int64_t i) { return i < 4; });  // row 0 sees all, row 1 nothing
  Tensor out = scaled_dot_product_attention(q, k, v, mask);
  const std::vector<double> o = out.to_vector();
  for (size_t i = 3; i < 6; ++i) CHECK(o[i] == 0.0);
  Tensor g = from_vector({0, 0, 0, 1, 1, 1}, {1, 1, 2, 3});  // gradient only on the masked row
  out.backward(g);
  for (double x : q.grad().to_vector()) CHECK(x == 0.0);
  for (double x : k.grad().to_vector()) CHECK(x == 0.0);
  for (double x : v.grad().to_vector()) CHECK(x == 0.0);
}

TEST_CASE("nn ops: scaled_dot_product_attention errors name the shapes") {
  Tensor q = zeros({1, 3, 2, 4}), k = zeros({1, 2, 5, 4}), v = zeros({1, 2, 5, 4});
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q, k, v),
                       doctest::Contains("query heads (3) must be a multiple of key/value heads (2)"), Error);
  Tensor q2 = zeros({1, 2, 2, 4});
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q2, k, v, zeros({2, 5})),
                       doctest::Contains("[scaled_dot_product_attention] mask must be bool"), Error);
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q2, k, v, zeros({3, 5}, {.dtype = DType::b8})),
                       doctest::Contains("mask of shape (3, 5) does not broadcast to (B, Hq, T, S) = (1, 2, 2, 5)"),
                       Error);
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q2, zeros({1, 2, 5, 3}), v),
                       doctest::Contains("q and k head dims differ"), Error);
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(zeros({2, 4}), k, v),
                       doctest::Contains("q, k, v must be (B, H, T, D)"), Error);
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q2, k, zeros({1, 2, 4, 4})),
                       doctest::Contains("differ in heads or length"), Error);
}

TEST_CASE("nn ops: swiglu is silu(gate) * up with broadcasting") {
  const std::vector<std::pair<Shape, Shape>> cases = {{{3, 5}, {3, 5}}, {{2, 3, 4}, {4}}, {{0, 3}, {0, 3}}, {{7}, {7}}};
  for (const auto& [ga, up] : cases) {
    run_op_case({.name = "swiglu", .inputs = {{ga}, {up}},
                 .op = [](const V& x) { return V{swiglu(x[0], x[1])}; },
                 .ref = [](const R& r) {
                   return R{zip(r[0], r[1], [](double g, double u) { return g / (1 + std::exp(-g)) * u; })};
                 }});
  }
  CHECK_THROWS_WITH_AS(swiglu(zeros({3}), zeros({4})),
                       doctest::Contains("[swiglu] shapes (3,) and (4,) do not broadcast"), Error);
}

TEST_CASE("nn ops: dropout matches its Philox definition, and its gradient uses the same mask") {
  const RngKey key(11, "dropout");
  const double p = 0.3;
  for (const Shape& s : {Shape{13}, Shape{3, 7}, Shape{0, 4}, Shape{}}) {
    run_op_case({.name = "dropout", .inputs = {{s}},
                 .op = [=](const V& x) { return V{dropout(x[0], p, key)}; },
                 .ref = [=](const R& r) {
                   Ref out(r[0].shape);
                   for (int64_t i = 0; i < out.numel(); ++i)
                     out[i] = philox_keeps(key.seed, key.key, i, p) ? r[0][i] / (1 - p) : 0.0;
                   return R{out};
                 }});
  }
  Tensor x = randn({50, 40}, RngKey(11, "x"), {.requires_grad = true});
  Tensor y = dropout(x, p, key);
  y.backward(ones_like(y));
  const std::vector<double> yv = y.to_vector(), gv = x.grad().to_vector();
  int64_t differ = 0;  // the gradient is 1/(1-p) exactly where the output was kept, else 0
  for (size_t i = 0; i < yv.size(); ++i) differ += std::abs(gv[i] - (yv[i] != 0.0 ? 1 / (1 - p) : 0.0)) > 1e-6;
  CHECK(differ == 0);
}

TEST_CASE("nn ops: dropout keeps about 1-p, scales by 1/(1-p), and its mask depends only on (seed, key, index)") {
  const int64_t n = 200000;
  Tensor x = ones({n});
  for (double p : {0.1, 0.5, 0.9}) {
    CAPTURE(p);
    const std::vector<double> y = dropout(x, p, RngKey(12, "a")).to_vector();
    int64_t kept = 0, misscaled = 0;
    for (double v : y) {
      kept += v != 0;
      misscaled += v != 0 && std::abs(v - 1 / (1 - p)) > 1e-6 / (1 - p);
    }
    CHECK(misscaled == 0);
    CHECK(std::abs(double(kept) / double(n) - (1 - p)) < 0.005);  // about 7 standard deviations
  }
  Tensor a = dropout(x, 0.5, RngKey(12, "a")), a2 = dropout(x, 0.5, RngKey(12, "a"));
  Tensor b = dropout(x, 0.5, RngKey(12, "b")), c = dropout(x, 0.5, RngKey(13, "a"));
  CHECK(a.to_vector() == a2.to_vector());
  CHECK(a.to_vector() != b.to_vector());
  CHECK(a.to_vector() != c.to_vector());
  // A shard's mask is the prefix of the full one: index, not call order or size, decides.
  const std::vector<double> full = a.to_vector(), head = dropout(ones({1000}), 0.5, RngKey(12, "a")).to_vector();
  CHECK(std::equal(head.begin(), head.end(), full.begin()));
  // The mask follows the logical (row-major) index, whatever the layout of x.
  Tensor m = randn({6, 9}, RngKey(12, "m"));
  Tensor mt = m.transpose(0, 1).contiguous().transpose(0, 1);
  CHECK(dropout(m, 0.4, RngKey(12, "m")).to_vector() == dropout(mt, 0.4, RngKey(12, "m")).to_vector());
}

TEST_CASE("nn ops: dropout is the identity in eval mode or at p = 0, and zeroes everything at p = 1") {
  Tensor x = randn({4, 5}, RngKey(14, "x"), {.requires_grad = true});
  CHECK(dropout(x, 0.5, RngKey(14, "k"), false).is_same(x));
  CHECK(dropout(x, 0.0, RngKey(14, "k")).is_same(x));
  Generator gen(3);
  CHECK(dropout(x, 0.5, gen, false).is_same(x));
  CHECK(gen.counter() == 0);  // eval draws no key
  Tensor z = dropout(x, 1.0, RngKey(14, "k"));
  for (double v : z.to_vector()) CHECK(v == 0.0);
  sum(z).backward();
  for (double v : x.grad().to_vector()) CHECK(v == 0.0);
  CHECK_THROWS_WITH_AS(dropout(x, 1.5, RngKey(14, "k")), doctest::Contains("[dropout] p must be in [0, 1], got 1.5"),
                       Error);
  CHECK_THROWS_WITH_AS(dropout(x, -0.1, gen), doctest::Contains("[dropout] p must be in [0, 1]"), Error);
  CHECK_THROWS_WITH_AS(dropout(zeros({3}, {.dtype = DType::i64}), 0.5, RngKey(14, "k")),
                       doctest::Contains("[dropout] needs a floating tensor"), Error);
}

TEST_CASE("nn ops: dropout with a Generator draws a fresh key per call and replays from its counter") {
  Tensor x = ones({64});
  Generator gen(21);
  const std::vector<double> first = dropout(x, 0.5, gen).to_vector();
  const std::vector<double> second = dropout(x, 0.5, gen).to_vector();
  CHECK(first != second);
  gen.set_counter(0);  // what activation checkpointing does before recomputing
  CHECK(dropout(x, 0.5, gen).to_vector() == first);
  CHECK(dropout(x, 0.5, gen).to_vector() == second);
}

TEST_CASE("nn ops: dropout_mask (the CUDA path's mask) equals the fused CPU kernel's mask bit for bit") {
  const int64_t n = 100000;
  for (double p : {0.1, 1.0 / 3.0, 0.5, 0.999, 5.96e-8, 0x1p-24, 1.0}) {
    CAPTURE(p);
    const RngKey key(15, "mask");
    const std::vector<double> kernel = dropout(ones({n}), p, key).to_vector();
    const std::vector<double> mask = dropout_mask({n}, p, key).to_vector();
    int64_t mismatches = 0;
    for (int64_t i = 0; i < n; ++i) mismatches += (kernel[size_t(i)] != 0.0) != (mask[size_t(i)] != 0.0);
    CHECK(mismatches == 0);
  }
}

TEST_CASE("nn ops: backward primitives are themselves differentiable in the incoming gradient") {
  // grad_x of op(x) as a function of the seed g: checks SoftmaxBackward, CrossEntropyBackward and
  // EmbeddingBackward's own backward by finite differences in g.
  auto seeded_grad = [](const Tensor& x, const Tensor& g, const std::function<Tensor(const Tensor&)>& f) {
    EnableGradGuard eg;
    Tensor leaf = x.detach();
    leaf.set_requires_grad(true);
    return grad({f(leaf)}, {leaf}, {g}, false, true)[0];
  };
  for (bool log : {false, true}) {
    run_op_case({.name = log ? "log_softmax double backward" : "softmax double backward",
                 .inputs = {{{3, 5}, Gen::normal, false}, {{3, 5}}},
                 .op = [=](const V& x) {
                   auto f = [=](const Tensor& t) { return log ? log_softmax(t, 0) : softmax(t, 0); };
                   return V{seeded_grad(x[0], x[1], f)};
                 },
                 .ref = [=](const R& r) {
                   const Ref y = softmax_ref(r[0], 0, log);
                   Ref out(r[0].shape);
                   for_each_line(r[0].shape, 0, [&](const std::vector<int64_t>& o) {
                     double sg = 0, sgy = 0;
                     for (int64_t i : o) { sg += r[1][i]; sgy += r[1][i] * y[i]; }
                     for (int64_t i : o) out[i] = log ? r[1][i] - std::exp(y[i]) * sg : y[i] * (r[1][i] - sgy);
                   });
                   return R{out};
                 },
                 .noncontig = false});
  }
  run_op_case({.name = "cross_entropy double backward",
               .inputs = {{{4, 6}, Gen::normal, false}, {{4}, Gen::index, false, 6}, {{4}}},
               .op = [=](const V& x) {
                 Tensor t = where(bool_tensor({4}, [](int64_t i) { return i == 2; }, x[1].device()),
                                  scalar_like(-100, x[1]), x[1]);
                 auto f = [&](const Tensor& l) { return cross_entropy(l, t, -100, Reduction::none); };
                 return V{seeded_grad(x[0], x[2], f)};
               },
               .ref = [](const R& r) {
                 const Ref p = softmax_ref(r[0], 1, false);
                 Ref out(r[0].shape);
                 for (int64_t i = 0; i < 4; ++i)
                   for (int64_t j = 0; j < 6; ++j)
                     out[i * 6 + j] = i == 2 ? 0.0 : r[2][i] * (p[i * 6 + j] - (int64_t(r[1][i]) == j ? 1.0 : 0.0));
                 return R{out};
               },
               .noncontig = false});
  run_op_case({.name = "embedding double backward",
               .inputs = {{{5, 3}, Gen::normal, false}, {{7}, Gen::index, false, 5}, {{7, 3}}},
               .op = [=](const V& x) {
                 return V{seeded_grad(x[0], x[2], [&](const Tensor& w) { return embedding(w, x[1]); })};
               },
               .ref = [](const R& r) {
                 Ref out(r[0].shape);
                 for (int64_t i = 0; i < 7; ++i)
                   for (int64_t j = 0; j < 3; ++j) out[int64_t(r[1][i]) * 3 + j] += r[2][i * 3 + j];
                 return R{out};
               },
               .noncontig = false});
}

// ---- fused primitives: swiglu, rotary embedding, residual add + RMS norm, cross entropy's kept
// logsumexp ----

TEST_CASE("nn ops: fused swiglu matches silu(gate) * up forward and backward, in every dtype") {
  // Same shapes take the fused primitive; sizes straddle the kernel's 1024-element blocks and
  // its parallel grain.
  for (const Shape& s : {Shape{3, 5}, Shape{1023}, Shape{2, 1025}, Shape{40, 1000}}) {
    run_op_case({.name = "swiglu fused", .inputs = {{s}, {s}},
                 .op = [](const V& x) { return V{swiglu(x[0], x[1])}; },
                 .ref = [](const R& r) {
                   return R{zip(r[0], r[1], [](double g, double u) { return g / (1 + std::exp(-g)) * u; })};
                 },
                 .gradcheck = numel_of(s) <= 2100});
  }
  // Against the composite in f32: the same values within rounding, gradients too.
  Tensor g = randn({64, 130}, RngKey(3, "g")).set_requires_grad(), u = randn({64, 130}, RngKey(3, "u")).set_requires_grad();
  Tensor seed = randn({64, 130}, RngKey(3, "s"));
  Tensor y = swiglu(g, u);
  Tensor want = silu(g) * u;
  const std::vector<double> a = y.to_vector(), b = want.to_vector();
  // (a few f32 ulps: the composite rounds silu(gate) before the product)
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-5).scale(1e-6));
  auto gf = grad({y}, {g, u}, {seed});
  auto gc = grad({want}, {g, u}, {seed});
  for (int k = 0; k < 2; ++k) {
    const std::vector<double> x1 = gf[size_t(k)].to_vector(), x2 = gc[size_t(k)].to_vector();
    // (gradients near zero lose relative precision to f32 cancellation: an absolute floor of 1e-8)
    for (size_t i = 0; i < x1.size(); ++i) CHECK(x1[i] == doctest::Approx(x2[i]).epsilon(1e-4).scale(1e-4));
  }
  // Extreme gates stay finite: silu(-100) = -0, silu(100) = 100.
  Tensor e = swiglu(from_vector({-100.0, 100.0, 0.0}, {3}), ones({3}));
  CHECK(e.to_vector() == std::vector<double>{-0.0, 100.0, 0.0});
}

TEST_CASE("nn ops: fused rotary_embedding matches the reference for strided q, broadcast tables and every dtype") {
  // Tables without gradients take the fused primitive. x shapes as the model holds q and k:
  // (B, H, T, D) with (T, D/2) tables, (B, T, H, D) with (T, 1, D/2), per-batch (B, 1, T, D/2)
  // tables, 2-d x, and an empty T.
  const std::vector<std::pair<Shape, Shape>> cases = {{{2, 3, 5, 8}, {5, 4}},       {{2, 5, 3, 6}, {5, 1, 3}},
                                                      {{2, 3, 4, 4}, {2, 1, 4, 2}}, {{7, 2}, {7, 1}},
                                                      {{1, 2, 0, 4}, {0, 2}},       {{3, 4}, {2}}};
  for (const auto& [xs, ts] : cases) {
    run_op_case({.name = "rotary_embedding fused", .inputs = {{xs}, {ts, Gen::normal, false}, {ts, Gen::normal, false}},
                 .op = [](const V& x) { return V{rotary_embedding(x[0], x[1], x[2])}; },
                 .ref = [](const R& r) { return R{rotary_ref(r[0], r[1], r[2])}; }});
  }
  // q as the model makes it: a (B, T, H, D) projection viewed as (B, H, T, D); fused == composite.
  // The kernel walks such a view in tiles of 16 positions by every head: T 6 is one partial
  // tile, T 37 two whole ones and a partial one, in f32 and bf16.
  for (const DType dt : {DType::f32, DType::bf16}) {
    for (const int64_t t : {6, 37}) {
      CAPTURE(t);
      Tensor q = randn({2, t, 3, 8}, RngKey(5, "q")).to(dt).transpose(1, 2);
      Tensor c = randn({t, 4}, RngKey(5, "c")), sn = randn({t, 4}, RngKey(5, "s"));
      // (the composite in f32, its tables rounded to q's dtype as the fused op rounds them)
      Tensor cg = c.to(dt).to(DType::f32).set_requires_grad(), sg = sn.to(dt).to(DType::f32).set_requires_grad();
      const Tensor fused = rotary_embedding(q, c, sn), composite = rotary_embedding(q.to(DType::f32), cg, sg);
      CHECK(fused.is_contiguous());
      const std::vector<double> a = fused.to_vector(), b = composite.to_vector();
      REQUIRE(a.size() == b.size());
      // (a few f32 ulps of the products, which the composite rounds before the sum; bf16 rounds
      // the result once: half a bf16 ulp)
      const double eps = dt == DType::f32 ? 1e-6 : 4e-3;
      for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(eps).scale(1.0));
    }
  }
}

TEST_CASE("nn ops: fused rotary_embedding's backward (the inverse rotation) is itself differentiable") {
  auto seeded_grad = [](const Tensor& x, const Tensor& g, const Tensor& c, const Tensor& s) {
    EnableGradGuard eg;
    Tensor leaf = x.detach();
    leaf.set_requires_grad(true);
    return grad({rotary_embedding(leaf, c, s)}, {leaf}, {g}, false, true)[0];
  };
  // d/dg of R^T g is R^T: the reference rotates g by -sin.
  run_op_case({.name = "rotary_embedding double backward",
               .inputs = {{{2, 3, 6}, Gen::normal, false}, {{3, 3}, Gen::normal, false}, {{3, 3}, Gen::normal, false},
                          {{2, 3, 6}}},
               .op = [=](const V& x) { return V{seeded_grad(x[0], x[3], x[1], x[2])}; },
               .ref = [](const R& r) { return R{rotary_ref(r[3], r[1], map(r[2], [](double v) { return -v; }))}; },
               .noncontig = false});
}

Ref add_rms_h_ref(const Ref& x, const Ref& r) { return zip(x, r, [](double a, double b) { return a + b; }); }

TEST_CASE("nn ops: add_rms_norm returns x + r and rms_norm of it, with gradients through both") {
  const std::vector<Shape> shapes = {{3, 7}, {2, 3, 33}, {1}, {0, 8}, {70, 600}};
  for (const Shape& s : shapes) {
    const double eps = 1e-6;
    const bool small = numel_of(s) < 1000;
    run_op_case({.name = "add_rms_norm", .inputs = {{s}, {s}, {{s.back()}}},
                 .op = [eps](const V& x) {
                   auto [h, y] = add_rms_norm(x[0], x[1], x[2], eps);
                   return V{h, y};
                 },
                 .ref = [eps](const R& r) {
                   const Ref h = add_rms_h_ref(r[0], r[1]);
                   return R{h, rms_norm_ref(h, &r[2], eps)};
                 },
                 .gradcheck = small});
    run_op_case({.name = "add_rms_norm without weight, y only", .inputs = {{s}, {s}},
                 .op = [](const V& x) { return V{add_rms_norm(x[0], x[1], Tensor(), 1e-3).second}; },
                 .ref = [](const R& r) { return R{rms_norm_ref(add_rms_h_ref(r[0], r[1]), nullptr, 1e-3)}; },
                 .gradcheck = small});
    run_op_case({.name = "add_rms_norm, h only", .inputs = {{s}, {s}, {{s.back()}}},
                 .op = [](const V& x) { return V{add_rms_norm(x[0], x[1], x[2], 1e-5).first}; },
                 .ref = [](const R& r) { return R{add_rms_h_ref(r[0], r[1])}; },
                 .gradcheck = small});
  }
}

TEST_CASE("nn ops: add_rms_norm equals x + r then rms_norm, values and gradients, in f32 and bf16") {
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    const Shape s{96, 257};
    Tensor x = randn(s, RngKey(7, "x"), {.dtype = dt}).set_requires_grad();
    Tensor r = randn(s, RngKey(7, "r"), {.dtype = dt}).set_requires_grad();
    Tensor w = randn({257}, RngKey(7, "w"), {.dtype = dt}).set_requires_grad();
    Tensor gh = randn(s, RngKey(7, "gh"), {.dtype = dt}), gy = randn(s, RngKey(7, "gy"), {.dtype = dt});
    auto [h, y] = add_rms_norm(x, r, w, 1e-5);
    const Tensor h2 = x + r, y2 = rms_norm(h2, w, 1e-5);
    CHECK(h.to_vector() == h2.to_vector());  // the add rounds once, as add does
    CHECK(y.to_vector() == y2.to_vector());  // and the norm reads the stored h
    auto g1 = grad({h, y}, {x, r, w}, {gh, gy});
    auto g2 = grad({h2, y2}, {x, r, w}, {gh, gy});
    // Unfused, grad_x rounds the norm's gradient and the residual's before their sum; terms are
    // O(1), so the two differ by a few roundings at that scale (the fused one is the closer).
    const double tol = dt == DType::bf16 ? 2e-2 : 1e-5;
    for (size_t k = 0; k < 3; ++k) {
      const std::vector<double> a = g1[k].to_vector(), b = g2[k].to_vector();
      for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(tol).scale(1.0));
    }
  }
}

TEST_CASE("nn ops: add_rms_norm errors name the shapes") {
  CHECK_THROWS_WITH_AS(add_rms_norm(zeros({2, 4}), zeros({2, 3}), Tensor()),
                       doctest::Contains("[add_rms_norm] residual (2, 3) f32 does not match x (2, 4) f32"), Error);
  CHECK_THROWS_WITH_AS(add_rms_norm(zeros({2, 4}), zeros({2, 4}, {.dtype = DType::bf16}), Tensor()),
                       doctest::Contains("[add_rms_norm] residual (2, 4) bf16 does not match x (2, 4) f32"), Error);
  CHECK_THROWS_WITH_AS(add_rms_norm(zeros({2, 4}), zeros({2, 4}), zeros({3})),
                       doctest::Contains("[add_rms_norm] weight of shape (3,) does not match the last dim of x (2, 4)"),
                       Error);
  CHECK_THROWS_WITH_AS(add_rms_norm(zeros({2, 4}), Tensor(), Tensor()),
                       doctest::Contains("[add_rms_norm] got an undefined residual"), Error);
}

TEST_CASE("nn ops: cross_entropy's backward from the kept logsumexp equals the recomputing one bit for bit") {
  // The kernel with the forward's lse (what cross_entropy's backward uses on the CPU) against
  // the same kernel recomputing each row's logsumexp, with an ignored row, in f32 and bf16.
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dt));
    const int64_t n = 37, c = 1000;
    Tensor x = randn({n, c}, RngKey(2, "x"), {.dtype = dt}) * 4.0;
    Tensor t = randint(0, c, {n}, RngKey(2, "t"));
    t = where(bool_tensor({n}, [](int64_t i) { return i == 5; }), scalar_like(-100, t), t);
    Tensor loss = Tensor::empty({n}), lse = Tensor::empty({n}), scale = rand({n}, RngKey(2, "k"));
    kernels::cpu::cross_entropy_forward(dt, loss.data_ptr(), x.data_ptr(), DType::i64, t.data_ptr(), n, c, -100,
                                        lse.data_ptr());
    Tensor g1 = Tensor::empty({n, c}, {.dtype = dt}), g2 = Tensor::empty({n, c}, {.dtype = dt});
    kernels::cpu::cross_entropy_backward(dt, g1.data_ptr(), x.data_ptr(), DType::i64, t.data_ptr(), scale.data_ptr(),
                                         n, c, -100, lse.data_ptr());
    kernels::cpu::cross_entropy_backward(dt, g2.data_ptr(), x.data_ptr(), DType::i64, t.data_ptr(), scale.data_ptr(),
                                         n, c, -100, nullptr);
    CHECK(g1.to_vector() == g2.to_vector());
    CHECK(lse.to_vector()[5] == 0.0);
    // And the op's gradient (which takes the kept lse) is scale * (softmax - onehot).
    Tensor xl = x.detach().set_requires_grad();
    Tensor l = cross_entropy(xl, t, -100, Reduction::sum);
    Tensor gx = grad({l}, {xl})[0];
    Tensor g3 = Tensor::empty({n, c}, {.dtype = dt});
    Tensor ones_n = ones({n});
    kernels::cpu::cross_entropy_backward(dt, g3.data_ptr(), x.data_ptr(), DType::i64, t.data_ptr(),
                                         ones_n.data_ptr(), n, c, -100, nullptr);
    CHECK(gx.to_vector() == g3.to_vector());
  }
}

TEST_CASE("nn ops: softmax errors name the op and the dim") {
  CHECK_THROWS_WITH_AS(softmax(zeros({3}, {.dtype = DType::i32})),
                       doctest::Contains("[softmax] needs a floating tensor, got i32"), Error);
  CHECK_THROWS_WITH_AS(log_softmax(zeros({3, 4}), 2), doctest::Contains("[log_softmax] dim 2 out of range"), Error);
}
