// Indexing, joining and ordering ops (engine/ops/index.h) through the op harness, plus their
// documented semantics (stability, NaN order, duplicate indices, promotion) and error paths.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "op_harness.h"

using namespace quilt;
using namespace quilt::test;

namespace {

int64_t wrap(int64_t dim, int64_t ndim) { return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim; }

// ---- naive float64 references: plain loops over Ref ----

Ref gather_ref(const Ref& x, int64_t dim, const Ref& index) {
  Ref out(index.shape);
  if (x.dim() == 0) {
    out[0] = x[0];
    return out;
  }
  for (int64_t i = 0; i < index.numel(); ++i) {
    Shape src = unravel(i, index.shape);
    src[size_t(dim)] = int64_t(index[i]);
    out[i] = x.at(src);
  }
  return out;
}

Ref scatter_add_ref(const Ref& x, int64_t dim, const Ref& index, const Ref& src) {
  Ref out = x;
  for (int64_t i = 0; i < index.numel(); ++i) {
    Shape dst = unravel(i, index.shape);
    dst[size_t(dim)] = int64_t(index[i]);
    out.at(dst) += src[i];
  }
  return out;
}

Ref index_select_ref(const Ref& x, int64_t dim, const Ref& index) {
  Shape s = x.shape;
  s[size_t(dim)] = index.numel();
  Ref out(s);
  for (int64_t i = 0; i < out.numel(); ++i) {
    Shape p = unravel(i, s);
    p[size_t(dim)] = int64_t(index[p[size_t(dim)]]);
    out[i] = x.at(p);
  }
  return out;
}

Ref index_add_ref(const Ref& x, int64_t dim, const Ref& index, const Ref& src) {
  Ref out = x;
  for (int64_t i = 0; i < src.numel(); ++i) {
    Shape p = unravel(i, src.shape);
    p[size_t(dim)] = int64_t(index[p[size_t(dim)]]);
    out.at(p) += src[i];
  }
  return out;
}

Ref cat_ref(const std::vector<Ref>& xs, int64_t dim) {
  Shape s = xs[0].shape;
  s[size_t(dim)] = 0;
  for (const Ref& x : xs) s[size_t(dim)] += x.shape[size_t(dim)];
  Ref out(s);
  int64_t off = 0;
  for (const Ref& x : xs) {
    for (int64_t i = 0; i < x.numel(); ++i) {
      Shape p = unravel(i, x.shape);
      p[size_t(dim)] += off;
      out.at(p) = x[i];
    }
    off += x.shape[size_t(dim)];
  }
  return out;
}

Ref narrow_ref(const Ref& x, int64_t dim, int64_t start, int64_t len) {
  Shape s = x.shape;
  s[size_t(dim)] = len;
  Ref out(s);
  for (int64_t i = 0; i < out.numel(); ++i) {
    Shape p = unravel(i, s);
    p[size_t(dim)] += start;
    out[i] = x.at(p);
  }
  return out;
}

Ref unsqueeze_ref(Ref x, int64_t dim) {
  x.shape.insert(x.shape.begin() + dim, 1);
  return x;
}

// a ranks before b in the order the engine documents (NaN above every number).
bool ranks_below(double a, double b) { return !std::isnan(a) && (std::isnan(b) || a < b); }

// The first k of each row sorted along dim (descending or not), ties by position; values, positions.
R sort_ref(const Ref& x0, int64_t dim, int64_t k, bool descending) {
  Ref x = x0;
  const bool scalar = x.dim() == 0;
  if (scalar) x.shape = {1};
  Shape os = x.shape;
  os[size_t(dim)] = k;
  Ref vals(os), idx(os);
  Shape rows = x.shape;
  rows[size_t(dim)] = 1;
  const int64_t n = x.shape[size_t(dim)];
  for (int64_t r = 0; r < numel_of(rows); ++r) {
    Shape p = unravel(r, rows);
    std::vector<std::pair<double, int64_t>> row;
    for (int64_t j = 0; j < n; ++j) {
      p[size_t(dim)] = j;
      row.push_back({x.at(p), j});
    }
    // Insertion sort: obviously stable, obviously right.
    for (size_t a = 1; a < row.size(); ++a)
      for (size_t b = a; b > 0; --b) {
        const bool swap = descending ? ranks_below(row[b - 1].first, row[b].first) : ranks_below(row[b].first, row[b - 1].first);
        if (!swap) break;
        std::swap(row[b - 1], row[b]);
      }
    for (int64_t j = 0; j < k; ++j) {
      p[size_t(dim)] = j;
      vals.at(p) = row[size_t(j)].first;
      idx.at(p) = double(row[size_t(j)].second);
    }
  }
  if (scalar) vals.shape = idx.shape = {};
  return {vals, idx};
}

Ref cumsum_ref(const Ref& x, int64_t dim) {
  Ref out = x;
  if (x.dim() == 0) return out;
  for (int64_t i = 0; i < x.numel(); ++i) {
    Shape p = unravel(i, x.shape);
    if (p[size_t(dim)] == 0) continue;
    p[size_t(dim)] -= 1;
    out[i] = x[i] + out.at(p);  // row-major order: the previous element is already done
  }
  return out;
}

Ref one_hot_ref(const Ref& idx, int64_t classes) {
  Shape s = idx.shape;
  s.push_back(classes);
  Ref out(s);
  for (int64_t i = 0; i < idx.numel(); ++i) out[i * classes + int64_t(idx[i])] = 1;
  return out;
}

In index_in(Shape shape, int64_t high, DType dt = DType::i64) {
  return In{.shape = std::move(shape), .gen = Gen::index, .grad = false, .index_high = high, .index_dtype = dt};
}

// A tensor that claims to live on a CUDA device (host memory underneath): enough to reach the
// device checks, which fire before any data is touched.
Tensor fake_cuda(const Shape& shape, DType dt, std::vector<double>& backing) {
  backing.assign(size_t(std::max<int64_t>(1, numel_of(shape))), 0.0);
  Storage s = Storage::borrow(backing.data(), backing.size() * sizeof(double), Device::cuda(0), nullptr);
  return Tensor::from_storage(s, shape, contiguous_strides(shape), 0, dt);
}

}  // namespace

TEST_CASE("index ops: gather matches its reference along every dim, with i32 and i64 indices") {
  struct G { Shape x, index; int64_t dim; DType idt; };
  const std::vector<G> cases = {
      {{4, 6}, {4, 3}, 1, DType::i64},   {{4, 6}, {4, 9}, -1, DType::i32}, {{5, 3}, {7, 3}, 0, DType::i64},
      {{2, 3, 5}, {2, 4, 3}, 1, DType::i32}, {{3, 4, 5}, {2, 3, 7}, -1, DType::i64}, {{7}, {11}, 0, DType::i64},
      {{0, 3}, {0, 3}, 1, DType::i64},   {{3, 4}, {3, 0}, 1, DType::i64},   {{3, 4}, {0, 4}, 0, DType::i32},
      {{}, {}, 0, DType::i64}};
  for (const auto& c : cases) {
    const int64_t d = wrap(c.dim, int64_t(c.x.size()));
    const int64_t high = c.x.empty() ? 1 : c.x[size_t(d)];
    run_op_case({.name = "gather", .inputs = {{c.x}, index_in(c.index, high, c.idt)},
                 .op = [&](const V& x) { return V{gather(x[0], c.dim, x[1])}; },
                 .ref = [&](const R& r) { return R{gather_ref(r[0], d, r[1])}; }});
  }
}

TEST_CASE("index ops: scatter_add accumulates duplicate indices and passes the harness") {
  struct S { Shape x, index; int64_t dim; DType idt; };
  const std::vector<S> cases = {
      {{4, 6}, {4, 3}, 1, DType::i64},  {{5, 4}, {9, 4}, 0, DType::i32},   {{3, 4, 5}, {2, 6, 5}, 1, DType::i64},
      {{3, 4, 5}, {3, 2, 9}, -1, DType::i32}, {{6}, {13}, -1, DType::i64}, {{0, 4}, {0, 4}, 1, DType::i64},
      {{3, 4}, {3, 0}, 1, DType::i64}};
  for (const auto& c : cases) {
    const int64_t d = wrap(c.dim, int64_t(c.x.size()));
    run_op_case({.name = "scatter_add", .inputs = {{c.x}, index_in(c.index, c.x[size_t(d)], c.idt), {c.index}},
                 .op = [&](const V& x) { return V{scatter_add(x[0], c.dim, x[1], x[2])}; },
                 .ref = [&](const R& r) { return R{scatter_add_ref(r[0], d, r[1], r[2])}; },
                 .lowp_tol = 4e-2});
  }
}

TEST_CASE("index ops: index_select picks slices along any dim, 0-d and empty indices included") {
  struct S { Shape x, index; int64_t dim; DType idt; };
  const std::vector<S> cases = {
      {{5, 4}, {7}, 0, DType::i64},  {{3, 6}, {4}, -1, DType::i32}, {{2, 5, 3}, {6}, 1, DType::i64},
      {{2, 5, 3}, {}, -2, DType::i64}, {{5, 4}, {0}, 0, DType::i32}, {{0, 3}, {2}, 1, DType::i64},
      {{9}, {4}, 0, DType::i64}};
  for (const auto& c : cases) {
    const int64_t d = wrap(c.dim, int64_t(c.x.size()));
    run_op_case({.name = "index_select", .inputs = {{c.x}, index_in(c.index, c.x[size_t(d)], c.idt)},
                 .op = [&](const V& x) { return V{index_select(x[0], c.dim, x[1])}; },
                 .ref = [&](const R& r) { return R{index_select_ref(r[0], d, r[1])}; }});
  }
}

TEST_CASE("index ops: index_add adds slices at indexed rows, duplicates accumulating") {
  struct S { Shape x; int64_t k, dim; DType idt; };
  const std::vector<S> cases = {
      {{5, 4}, 7, 0, DType::i64}, {{3, 6}, 4, -1, DType::i32}, {{2, 5, 3}, 8, 1, DType::i64},
      {{5, 4}, 0, 0, DType::i64}, {{0, 3}, 2, 1, DType::i32}, {{6}, 9, 0, DType::i64}};
  for (const auto& c : cases) {
    const int64_t d = wrap(c.dim, int64_t(c.x.size()));
    Shape src = c.x;
    src[size_t(d)] = c.k;
    run_op_case({.name = "index_add", .inputs = {{c.x}, index_in({c.k}, c.x[size_t(d)], c.idt), {src}},
                 .op = [&](const V& x) { return V{index_add(x[0], c.dim, x[1], x[2])}; },
                 .ref = [&](const R& r) { return R{index_add_ref(r[0], d, r[1], r[2])}; },
                 .lowp_tol = 4e-2});
  }
}

TEST_CASE("index ops: cat joins along any dim, including pieces empty along it") {
  struct C { std::vector<Shape> xs; int64_t dim; };
  const std::vector<C> cases = {
      {{{2, 3}, {4, 3}, {1, 3}}, 0}, {{{3, 2}, {3, 5}}, -1}, {{{0, 3}, {2, 3}, {0, 3}}, 0},
      {{{3, 0}, {3, 4}}, 1}, {{{2, 1, 3}, {2, 4, 3}, {2, 2, 3}}, 1}, {{{5}, {0}, {3}}, -1}, {{{0, 2}, {0, 2}}, 0},
      {{{4, 3}}, 1}};
  for (const auto& c : cases) {
    std::vector<In> ins;
    for (const Shape& s : c.xs) ins.push_back({s});
    const int64_t d = wrap(c.dim, int64_t(c.xs[0].size()));
    run_op_case({.name = "cat", .inputs = ins,
                 .op = [&](const V& x) { return V{cat(x, c.dim)}; },
                 .ref = [&](const R& r) { return R{cat_ref(r, d)}; }});
  }
}

TEST_CASE("index ops: stack inserts a new dim at any position") {
  for (int64_t dim : {0, 1, 2, -1, -3}) {
    run_op_case({.name = "stack", .inputs = {{{3, 4}}, {{3, 4}}, {{3, 4}}},
                 .op = [&](const V& x) { return V{stack(x, dim)}; },
                 .ref = [&](const R& r) {
                   const int64_t d = dim < 0 ? dim + 3 : dim;
                   std::vector<Ref> u;
                   for (const Ref& x : r) u.push_back(unsqueeze_ref(x, d));
                   return R{cat_ref(u, d)};
                 }});
  }
  run_op_case({.name = "stack of empties", .inputs = {{{0, 3}}, {{0, 3}}},
               .op = [](const V& x) { return V{stack(x, 1)}; },
               .ref = [](const R& r) { return R{Ref({0, 2, 3})}; }});
  run_op_case({.name = "stack of 0-d", .inputs = {{{}}, {{}}, {{}}},
               .op = [](const V& x) { return V{stack(x)}; },
               .ref = [](const R& r) { return R{Ref({3}, {r[0][0], r[1][0], r[2][0]})}; }});
}

TEST_CASE("index ops: split by size and by sizes, and chunk, give narrow views") {
  struct P { Shape x; int64_t dim; std::vector<int64_t> starts, lens; std::function<V(const Tensor&)> f; };
  const std::vector<P> cases = {
      {{5, 3}, 0, {0, 2, 4}, {2, 2, 1}, [](const Tensor& t) { return split(t, 2, 0); }},
      {{3, 7}, -1, {0, 3, 6}, {3, 3, 1}, [](const Tensor& t) { return split(t, 3, -1); }},
      {{5, 3}, 0, {0, 1, 1}, {1, 0, 4}, [](const Tensor& t) { return split(t, std::vector<int64_t>{1, 0, 4}, 0); }},
      {{2, 6, 3}, 1, {0, 2, 5}, {2, 3, 1}, [](const Tensor& t) { return split(t, std::vector<int64_t>{2, 3, 1}, -2); }},
      {{4, 7}, 1, {0, 3, 6}, {3, 3, 1}, [](const Tensor& t) { return chunk(t, 3, 1); }},
      {{6, 2}, 0, {0, 2, 4}, {2, 2, 2}, [](const Tensor& t) { return chunk(t, 4, 0); }},  // fewer than asked
      {{5}, 0, {0, 2, 4}, {2, 2, 1}, [](const Tensor& t) { return chunk(t, 3, -1); }},
      {{0, 3}, 0, {0, 0, 0}, {0, 0, 0}, [](const Tensor& t) { return chunk(t, 3, 0); }},
      {{0, 3}, 0, {0}, {0}, [](const Tensor& t) { return split(t, 2, 0); }},
      {{4, 3}, 1, {0}, {3}, [](const Tensor& t) { return split(t, 5, 1); }}};
  for (const auto& c : cases) {
    run_op_case({.name = "split/chunk", .inputs = {{c.x}},
                 .op = [&](const V& x) { return c.f(x[0]); },
                 .ref = [&](const R& r) {
                   R out;
                   for (size_t i = 0; i < c.starts.size(); ++i)
                     out.push_back(narrow_ref(r[0], wrap(c.dim, r[0].dim()), c.starts[i], c.lens[i]));
                   return out;
                 }});
  }
  Tensor x = zeros({4, 6});
  auto parts = split(x, 4, 1);
  REQUIRE(parts.size() == 2);
  CHECK(parts[1].storage().data() == x.storage().data());  // a view, not a copy
  CHECK(parts[1].offset() == 4);
}

TEST_CASE("index ops: topk returns sorted largest or smallest values with their positions") {
  struct T { Shape x; int64_t k, dim; bool largest; };
  const std::vector<T> cases = {
      {{4, 7}, 3, -1, true}, {{4, 7}, 3, 1, false}, {{5, 4}, 2, 0, true}, {{4, 7}, 7, -1, true},
      {{4, 7}, 0, -1, true}, {{11}, 4, 0, false}, {{2, 5, 3}, 2, 1, true}, {{2, 5, 3}, 3, -1, false},
      {{0, 5}, 2, 1, true}, {{3, 0}, 0, -1, true}, {{}, 1, 0, true}};
  for (const auto& c : cases) {
    const int64_t d = wrap(c.dim, int64_t(c.x.size()));
    run_op_case({.name = "topk", .inputs = {{c.x, Gen::distinct}},
                 .op = [&](const V& x) {
                   auto [v, i] = topk(x[0], c.k, c.dim, c.largest);
                   return V{v, i};
                 },
                 .ref = [&](const R& r) { return sort_ref(r[0], d, c.k, c.largest); }});
  }
}

TEST_CASE("index ops: sort and argsort order along any dim, ascending and descending") {
  struct S { Shape x; int64_t dim; bool desc; };
  const std::vector<S> cases = {
      {{4, 7}, -1, false}, {{4, 7}, -1, true}, {{5, 3}, 0, false}, {{13}, 0, true}, {{2, 5, 3}, 1, false},
      {{2, 5, 3}, -3, true}, {{0, 4}, 1, false}, {{4, 0}, 1, true}, {{}, -1, false}, {{3, 1}, 1, false}};
  for (const auto& c : cases) {
    const int64_t d = wrap(c.dim, int64_t(c.x.size()));
    const int64_t n = c.x.empty() ? 1 : c.x[size_t(d)];
    run_op_case({.name = "sort", .inputs = {{c.x, Gen::distinct}},
                 .op = [&](const V& x) {
                   auto [v, i] = sort(x[0], c.dim, c.desc);
                   return V{v, i, argsort(x[0], c.dim, c.desc)};
                 },
                 .ref = [&](const R& r) {
                   R s = sort_ref(r[0], d, n, c.desc);
                   return R{s[0], s[1], s[1]};
                 }});
  }
}

TEST_CASE("index ops: cumsum runs along any dim and its gradient is the reversed cumsum") {
  struct C { Shape x; int64_t dim; };
  const std::vector<C> cases = {{{4, 7}, 1}, {{4, 7}, 0}, {{4, 7}, -1}, {{2, 5, 3}, 1}, {{2, 5, 3}, -3},
                                {{17}, 0}, {{0, 3}, 0}, {{3, 0}, 1}, {{}, 0}, {{5, 1}, 1}};
  for (const auto& c : cases) {
    const int64_t d = wrap(c.dim, int64_t(c.x.size()));
    run_op_case({.name = "cumsum", .inputs = {{c.x}},
                 .op = [&](const V& x) { return V{cumsum(x[0], c.dim)}; },
                 .ref = [&](const R& r) { return R{cumsum_ref(r[0], d)}; },
                 .lowp_tol = 6e-2});
  }
  // Integer and bool inputs sum in i64.
  run_op_case({.name = "cumsum of i32", .inputs = {index_in({3, 6}, 50, DType::i32)},
               .op = [](const V& x) {
                 Tensor y = cumsum(x[0], -1);
                 CHECK(y.dtype() == DType::i64);
                 return V{y};
               },
               .ref = [](const R& r) { return R{cumsum_ref(r[0], 1)}; }});
  Tensor b = from_vector({1, 0, 1, 1}, {4}, {.dtype = DType::b8});
  Tensor cb = cumsum(b, 0);
  CHECK(cb.dtype() == DType::i64);
  CHECK(cb.to_vector() == std::vector<double>{1, 1, 2, 3});
  Tensor x = from_vector({1, 2, 3, 4}, {4}, {.dtype = DType::f64, .requires_grad = true});
  Tensor w = from_vector({1, 10, 100, 1000}, {4}, {.dtype = DType::f64});
  sum(cumsum(x, 0) * w).backward();
  CHECK(x.grad().to_vector() == std::vector<double>{1111, 1110, 1100, 1000});
}

TEST_CASE("index ops: one_hot compares indices with every class") {
  struct O { Shape s; int64_t classes; DType idt; };
  const std::vector<O> cases = {{{5}, 4, DType::i64}, {{2, 3}, 6, DType::i32}, {{0}, 3, DType::i64}, {{}, 2, DType::i64},
                                {{4}, 1, DType::i32}};
  for (const auto& c : cases) {
    run_op_case({.name = "one_hot", .inputs = {index_in(c.s, c.classes, c.idt)},
                 .op = [&](const V& x) { return V{one_hot(x[0], c.classes)}; },
                 .ref = [&](const R& r) { return R{one_hot_ref(r[0], c.classes)}; }});
  }
  Tensor idx = from_vector({2, 0, 3}, {3}, {.dtype = DType::i32});
  Tensor f = one_hot(idx, -1, DType::f32);
  CHECK(f.dtype() == DType::f32);
  CHECK(f.shape() == Shape{3, 4});
  CHECK(f.to_vector() == std::vector<double>{0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1});
  CHECK(one_hot(zeros({0, 2}, {.dtype = DType::i64}), 0).shape() == Shape{0, 2, 0});
}

TEST_CASE("index ops: large gathers and scatters split across threads give the reference answer") {
  // Sizes above the kernels' grain, so several threads run; heavy duplication in the indices.
  run_op_case({.name = "big scatter_add dim 0", .inputs = {{{64, 512}}, index_in({300, 512}, 64), {{300, 512}}},
               .op = [](const V& x) { return V{scatter_add(x[0], 0, x[1], x[2])}; },
               .ref = [](const R& r) { return R{scatter_add_ref(r[0], 0, r[1], r[2])}; },
               .lowp = false, .gradcheck = false, .f32_tol = 1e-4});
  run_op_case({.name = "big scatter_add dim 1", .inputs = {{{300, 8}}, index_in({300, 200}, 8, DType::i32), {{300, 200}}},
               .op = [](const V& x) { return V{scatter_add(x[0], 1, x[1], x[2])}; },
               .ref = [](const R& r) { return R{scatter_add_ref(r[0], 1, r[1], r[2])}; },
               .lowp = false, .gradcheck = false, .f32_tol = 1e-4});
  run_op_case({.name = "big index_add", .inputs = {{{50, 300}}, index_in({400}, 50), {{400, 300}}},
               .op = [](const V& x) { return V{index_add(x[0], 0, x[1], x[2]), index_select(x[0], 0, x[1])}; },
               .ref = [](const R& r) { return R{index_add_ref(r[0], 0, r[1], r[2]), index_select_ref(r[0], 0, r[1])}; },
               .lowp = false, .gradcheck = false, .f32_tol = 1e-4});
  run_op_case({.name = "big gather", .inputs = {{{200, 300}}, index_in({200, 400}, 300)},
               .op = [](const V& x) { return V{gather(x[0], 1, x[1])}; },
               .ref = [](const R& r) { return R{gather_ref(r[0], 1, r[1])}; },
               .lowp = false, .gradcheck = false});
  run_op_case({.name = "big sort and cumsum", .inputs = {{{600, 90}}},
               .op = [](const V& x) {
                 auto [v, i] = sort(x[0], 0, true);
                 return V{v, i, cumsum(x[0], 0), cumsum(x[0], 1)};
               },
               .ref = [](const R& r) {
                 R s = sort_ref(r[0], 0, 600, true);
                 return R{s[0], s[1], cumsum_ref(r[0], 0), cumsum_ref(r[0], 1)};
               },
               .lowp = false, .gradcheck = false, .f32_tol = 1e-4});
}

TEST_CASE("index ops: sort is stable and topk breaks ties by the lower position") {
  Tensor x = from_vector({3, 1, 3, 1, 2}, {5});
  CHECK(sort(x).second.to_vector() == std::vector<double>{1, 3, 4, 0, 2});
  CHECK(sort(x, 0, true).second.to_vector() == std::vector<double>{0, 2, 4, 1, 3});
  CHECK(argsort(x, -1, true).to_vector() == std::vector<double>{0, 2, 4, 1, 3});
  Tensor y = from_vector({5, 7, 7, 1, 7}, {5}, {.dtype = DType::bf16});
  auto [v, i] = topk(y, 2);
  CHECK(v.dtype() == DType::bf16);
  CHECK(v.to_vector() == std::vector<double>{7, 7});
  CHECK(i.to_vector() == std::vector<double>{1, 2});
  auto [vs, is] = topk(y, 3, 0, false);
  CHECK(vs.to_vector() == std::vector<double>{1, 5, 7});
  CHECK(is.to_vector() == std::vector<double>{3, 0, 1});
  Tensor ints = from_vector({4, -2, 4, 9}, {4}, {.dtype = DType::i32});
  auto [iv, ii] = sort(ints);
  CHECK(iv.dtype() == DType::i32);
  CHECK(iv.to_vector() == std::vector<double>{-2, 4, 4, 9});
  CHECK(ii.to_vector() == std::vector<double>{1, 0, 2, 3});
}

TEST_CASE("index ops: long rows full of ties and NaNs sort stably in every dtype") {
  // Rows long enough for the kernels' radix path, drawn from a handful of values.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double pool[] = {2, -1, 0, -0.0, nan, 7, -1e30, INFINITY};
  std::vector<double> vals;
  for (int i = 0; i < 3 * 257; ++i) vals.push_back(pool[(i * 7 + i / 5) % 8]);
  Ref ref({3, 257}, vals);
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    INFO("dtype ", dtype_name(dt));
    Tensor x = from_vector(vals, {3, 257}, {.dtype = dt});
    Ref rx = Ref::of(x);  // the values as this dtype holds them
    for (bool desc : {false, true}) {
      const R want = sort_ref(rx, 1, 257, desc);
      auto [v, i] = sort(x, 1, desc);
      CHECK(i.to_vector() == want[1].v);
      const R top = sort_ref(rx, 1, 40, desc);
      CHECK(topk(x, 40, 1, desc).second.to_vector() == top[1].v);
    }
  }
  std::vector<double> ints;
  for (int i = 0; i < 300; ++i) ints.push_back(double((i * 37) % 11) - 5);
  for (DType dt : {DType::i32, DType::i64}) {
    Tensor x = from_vector(ints, {300}, {.dtype = dt});
    const R want = sort_ref(Ref({300}, ints), 0, 300, false);
    auto [v, i] = sort(x);
    CHECK(v.to_vector() == want[0].v);
    CHECK(i.to_vector() == want[1].v);
    CHECK(argsort(x, 0, true).to_vector() == sort_ref(Ref({300}, ints), 0, 300, true)[1].v);
  }
}

TEST_CASE("index ops: NaN ranks above every number in sort and topk") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    Tensor x = from_vector({1, nan, -INFINITY, nan, INFINITY}, {5}, {.dtype = dt});
    auto [a, ai] = sort(x);
    CHECK(ai.to_vector() == std::vector<double>{2, 0, 4, 1, 3});
    const auto av = a.to_vector();
    CHECK((av[0] == -INFINITY && av[1] == 1 && av[2] == INFINITY && std::isnan(av[3]) && std::isnan(av[4])));
    CHECK(sort(x, 0, true).second.to_vector() == std::vector<double>{1, 3, 4, 0, 2});
    CHECK(topk(x, 3).second.to_vector() == std::vector<double>{1, 3, 4});
    CHECK(topk(x, 2, 0, false).second.to_vector() == std::vector<double>{2, 0});
  }
}

TEST_CASE("index ops: scatter_add and index_add sum every duplicate exactly") {
  Tensor x = zeros({3}, {.dtype = DType::f64});
  Tensor idx = from_vector({0, 0, 2, 0}, {4}, {.dtype = DType::i32});
  Tensor src = from_vector({1, 2, 3, 4}, {4}, {.dtype = DType::f64});
  CHECK(scatter_add(x, 0, idx, src).to_vector() == std::vector<double>{7, 0, 3});
  Tensor rows = from_vector({1, 2, 3, 4, 5, 6, 7, 8}, {4, 2});
  CHECK(index_add(zeros({3, 2}), 0, idx, rows).to_vector() == std::vector<double>{1 + 3 + 7, 2 + 4 + 8, 0, 0, 5, 6});
  // Integer tensors accumulate too, and mixed dtypes promote.
  Tensor xi = zeros({3}, {.dtype = DType::i64});
  Tensor si = from_vector({1, 1, 1, 1}, {4}, {.dtype = DType::i32});
  Tensor r = scatter_add(xi, 0, idx, si);
  CHECK(r.dtype() == DType::i64);
  CHECK(r.to_vector() == std::vector<double>{3, 0, 1});
  CHECK(scatter_add(zeros({3}, {.dtype = DType::f32}), 0, idx, src).dtype() == DType::f64);
  // The inputs are left untouched (out of place).
  CHECK(x.to_vector() == std::vector<double>{0, 0, 0});
}

TEST_CASE("index ops: cat promotes mixed dtypes and returns each gradient in its input's dtype") {
  Tensor a = from_vector({1, 2}, {2}, {.dtype = DType::f32, .requires_grad = true});
  Tensor b = from_vector({3, 4, 5}, {3}, {.dtype = DType::f64, .requires_grad = true});
  Tensor i = from_vector({6}, {1}, {.dtype = DType::i32});
  Tensor y = cat({a, b, i});
  CHECK(y.dtype() == DType::f64);
  CHECK(y.to_vector() == std::vector<double>{1, 2, 3, 4, 5, 6});
  sum(y * from_vector({1, 2, 3, 4, 5, 6}, {6}, {.dtype = DType::f64})).backward();
  CHECK(a.grad().dtype() == DType::f32);
  CHECK(a.grad().to_vector() == std::vector<double>{1, 2});
  CHECK(b.grad().dtype() == DType::f64);
  CHECK(b.grad().to_vector() == std::vector<double>{3, 4, 5});
  CHECK(cat({zeros({2}, {.dtype = DType::bf16}), zeros({1}, {.dtype = DType::f16})}).dtype() == DType::f32);
  CHECK(cat({zeros({2}, {.dtype = DType::b8}), zeros({1}, {.dtype = DType::i32})}).dtype() == DType::i32);
  CHECK(stack({zeros({2}, {.dtype = DType::i64}), zeros({2}, {.dtype = DType::f16})}).dtype() == DType::f16);
}

TEST_CASE("index ops: backward formulas are themselves differentiable ops") {
  // gather's backward is scatter_add of the incoming gradient, whose own backward is gather:
  // differentiating gather's input-gradient with respect to that incoming gradient gives w[idx].
  Tensor x = from_vector({1, 2, 3}, {3}, {.dtype = DType::f64, .requires_grad = true});
  Tensor idx = from_vector({2, 2, 0}, {3}, {.dtype = DType::i64});
  Tensor v = from_vector({1, 2, 3}, {3}, {.dtype = DType::f64, .requires_grad = true});
  Tensor gx = grad({gather(x, 0, idx)}, {x}, {v}, false, true)[0];
  CHECK(gx.to_vector() == std::vector<double>{3, 0, 3});
  Tensor w = from_vector({1, 10, 100}, {3}, {.dtype = DType::f64});
  Tensor gv = grad({sum(gx * w)}, {v})[0];
  CHECK(gv.to_vector() == std::vector<double>{100, 100, 1});
  Tensor s = from_vector({3, 1, 2}, {3}, {.dtype = DType::f64, .requires_grad = true});
  auto [sv, pos] = sort(s);
  sum(sv * from_vector({1, 10, 100}, {3}, {.dtype = DType::f64})).backward();
  CHECK(s.grad().to_vector() == std::vector<double>{100, 1, 10});
}

TEST_CASE("index ops: out-of-range indices throw naming the op, the value and the dim's size") {
  Tensor x = zeros({3, 6});
  Tensor bad = from_vector({0, 6, 1}, {1, 3}, {.dtype = DType::i64});
  CHECK_THROWS_WITH_AS(gather(x, 1, bad), doctest::Contains("[gather] index 6 is out of range for dim 1 of size 6"), Error);
  Tensor neg = from_vector({0, -1}, {1, 2}, {.dtype = DType::i32});
  CHECK_THROWS_WITH_AS(gather(x, -1, neg), doctest::Contains("[gather] index -1 is out of range for dim 1 of size 6"), Error);
  CHECK_THROWS_WITH_AS(scatter_add(x, 1, bad, zeros({1, 3})),
                       doctest::Contains("[scatter_add] index 6 is out of range for dim 1 of size 6"), Error);
  Tensor rows = from_vector({2, 3}, {2}, {.dtype = DType::i64});
  CHECK_THROWS_WITH_AS(index_select(x, 0, rows), doctest::Contains("[index_select] index 3 is out of range for dim 0 of size 3"),
                       Error);
  CHECK_THROWS_WITH_AS(index_add(x, 0, rows, zeros({2, 6})),
                       doctest::Contains("[index_add] index 3 is out of range for dim 0 of size 3"), Error);
  CHECK_THROWS_WITH_AS(index_select(zeros({0, 2}), 0, from_vector({0}, {1}, {.dtype = DType::i64})),
                       doctest::Contains("[index_select] index 0 is out of range for dim 0 of size 0"), Error);
  CHECK_THROWS_WITH_AS(one_hot(from_vector({1, 4}, {2}, {.dtype = DType::i64}), 4),
                       doctest::Contains("[one_hot] index 4 is out of range for 4 classes"), Error);
  CHECK_THROWS_WITH_AS(one_hot(from_vector({-2}, {1}, {.dtype = DType::i32}), 4),
                       doctest::Contains("[one_hot] index -2 is out of range"), Error);
}

TEST_CASE("index ops: bad index dtypes, shapes and dims throw naming both shapes") {
  Tensor x = zeros({3, 6});
  CHECK_THROWS_WITH_AS(gather(x, 1, zeros({3, 2})), doctest::Contains("[gather] index must be an i32 or i64 tensor, got f32"),
                       Error);
  CHECK_THROWS_WITH_AS(index_select(x, 0, zeros({2}, {.dtype = DType::b8})),
                       doctest::Contains("[index_select] index must be an i32 or i64 tensor, got bool"), Error);
  Tensor i2 = zeros({3}, {.dtype = DType::i64});
  CHECK_THROWS_WITH_AS(gather(x, 1, i2), doctest::Contains("[gather] x shape (3, 6) and index shape (3,) differ in rank"), Error);
  CHECK_THROWS_WITH_AS(gather(x, 1, zeros({4, 2}, {.dtype = DType::i64})),
                       doctest::Contains("[gather] index shape (4, 2) is larger than x shape (3, 6) in dim 0"), Error);
  CHECK_THROWS_WITH_AS(gather(x, 2, zeros({3, 2}, {.dtype = DType::i64})), doctest::Contains("[gather] dim 2 out of range"),
                       Error);
  CHECK_THROWS_WITH_AS(scatter_add(x, 1, zeros({3, 2}, {.dtype = DType::i64}), zeros({3, 3})),
                       doctest::Contains("[scatter_add] index shape (3, 2) and src shape (3, 3) must be equal"), Error);
  CHECK_THROWS_WITH_AS(scatter_add(zeros({2}, {.dtype = DType::b8}), 0, zeros({1}, {.dtype = DType::i64}),
                                   zeros({1}, {.dtype = DType::b8})),
                       doctest::Contains("[scatter_add] is not defined for bool tensors"), Error);
  CHECK_THROWS_WITH_AS(index_select(x, 0, zeros({2, 2}, {.dtype = DType::i64})),
                       doctest::Contains("[index_select] index must be 0-d or 1-D, got shape (2, 2)"), Error);
  CHECK_THROWS_WITH_AS(index_add(x, 1, zeros({2}, {.dtype = DType::i64}), zeros({3, 3})),
                       doctest::Contains("[index_add] src shape (3, 3) does not match x shape (3, 6) with dim 1 of size 2"),
                       Error);
  CHECK_THROWS_WITH_AS(cat({zeros({2, 3}), zeros({2, 4})}, 0),
                       doctest::Contains("[cat] tensor 1 has shape (2, 4) but tensor 0 has shape (2, 3)"), Error);
  CHECK_THROWS_WITH_AS(cat({zeros({2, 3}), zeros({6})}, 0),
                       doctest::Contains("[cat] tensor 1 has shape (6,) but tensor 0 has shape (2, 3)"), Error);
  CHECK_THROWS_WITH_AS(cat({}, 0), doctest::Contains("[cat] needs at least one tensor"), Error);
  CHECK_THROWS_WITH_AS(cat({zeros({2})}, 1), doctest::Contains("[cat] dim 1 out of range"), Error);
  CHECK_THROWS_WITH_AS(stack({zeros({2, 3}), zeros({3, 2})}),
                       doctest::Contains("[stack] tensor 1 has shape (3, 2) but tensor 0 has shape (2, 3)"), Error);
  CHECK_THROWS_WITH_AS(split(x, std::vector<int64_t>{2, 2}, 1),
                       doctest::Contains("[split] sizes (2, 2) add up to 4, but dim 1 of shape (3, 6) has size 6"), Error);
  CHECK_THROWS_WITH_AS(split(x, 0, 1), doctest::Contains("[split] piece size must be positive, got 0"), Error);
  CHECK_THROWS_WITH_AS(chunk(x, 0, 1), doctest::Contains("[chunk] number of chunks must be positive, got 0"), Error);
  CHECK_THROWS_WITH_AS(topk(x, 7), doctest::Contains("[topk] k 7 out of range for dim 1 of size 6"), Error);
  CHECK_THROWS_WITH_AS(topk(scalar_tensor(1.0), 0), doctest::Contains("[topk] k must be 1 for a 0-d tensor, got 0"), Error);
  CHECK_THROWS_WITH_AS(sort(x, -3), doctest::Contains("[sort] dim -3 out of range"), Error);
  CHECK_THROWS_WITH_AS(cumsum(x, 2), doctest::Contains("[cumsum] dim 2 out of range"), Error);
  CHECK_THROWS_WITH_AS(one_hot(zeros({0}, {.dtype = DType::i64}), -1),
                       doctest::Contains("[one_hot] cannot infer num_classes from an empty tensor"), Error);
}

TEST_CASE("index ops: an index on another device than x is rejected by name") {
  // The six kernels run on CUDA now (tests/engine/cuda_nn_test.cpp); what stays is that a CPU
  // index with a CUDA x is caught by a device check, not by a wrong-device read.
  std::vector<double> bx;
  Tensor x = fake_cuda({2, 3}, DType::f32, bx);
  const Tensor cpu_idx = zeros({2, 3}, {.dtype = DType::i64});
  CHECK_THROWS_WITH_AS(gather(x, 1, cpu_idx), doctest::Contains("[gather] inputs on different devices"), Error);
  CHECK_THROWS_WITH_AS(scatter_add(x, 1, cpu_idx, x), doctest::Contains("[scatter_add] inputs on different devices"),
                       Error);
  CHECK_THROWS_WITH_AS(index_select(x, 1, cpu_idx.select(0, 0)),
                       doctest::Contains("[index_select] inputs on different devices"), Error);
  CHECK_THROWS_WITH_AS(index_add(x, 1, cpu_idx.select(0, 0), x),
                       doctest::Contains("[index_add] inputs on different devices"), Error);
  CHECK_THROWS_WITH_AS(cat({x, zeros({2, 3})}), doctest::Contains("[cat] inputs on different devices"), Error);
}
