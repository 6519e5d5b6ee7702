// scaled_dot_product_attention's fused primitive: output and log-sum-exp against a float64
// reference (causal, S != T, explicit offsets, GQA, documents, ragged tiles, T = 1, queries
// that see nothing, causal by position), gradients by finite differences, bf16 rounding, the composite it replaced,
// the memory its backward keeps, its errors, and head/batch sharded distributed tensors.
#include <doctest/doctest.h>

#include <omp.h>

#include <cmath>
#include <functional>
#include <limits>
#include <tuple>

#include "kernels/cpu/attention.h"
#include "tests/dtensor/util.h"
#include "tests/engine/op_harness.h"

using namespace quilt;
using namespace quilt::test;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Whether query i of batch b may see key j.
using Sees = std::function<bool(int64_t b, int64_t i, int64_t j)>;

Sees causal_sees(int64_t offset) {
  return [offset](int64_t, int64_t i, int64_t j) { return j <= i + offset; };
}

// Queries and keys of one document; causal within it when `causal` (with offset S - T).
Sees document_sees(const Ref& qdoc, const Ref& kdoc, bool causal, int64_t offset) {
  return [=](int64_t b, int64_t i, int64_t j) {
    return qdoc.at({b, i}) == kdoc.at({b, j}) && (!causal || j <= i + offset);
  };
}

// {softmax(scale q kᵀ) v, logsumexp(scale q kᵀ)} over the keys `sees` allows, in float64; a
// query that sees nothing gets zeros and -inf.
R attention_ref(const Ref& q, const Ref& k, const Ref& v, double scale, const Sees& sees) {
  const int64_t b = q.shape[0], hq = q.shape[1], t = q.shape[2], d = q.shape[3];
  const int64_t hkv = k.shape[1], s = k.shape[2], dv = v.shape[3];
  Ref out({b, hq, t, dv}), lse({b, hq, t}, -kInf);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < t; ++i) {
        const int64_t kh = h / (hq / hkv);
        std::vector<double> score(static_cast<size_t>(s), -kInf);
        double top = -kInf;
        for (int64_t j = 0; j < s; ++j) {
          if (!sees(bi, i, j)) continue;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += q.at({bi, h, i, c}) * k.at({bi, kh, j, c});
          score[size_t(j)] = dot * scale;
          top = std::max(top, score[size_t(j)]);
        }
        if (top == -kInf) continue;
        double z = 0;
        for (double x : score) z += std::exp(x - top);
        lse.at({bi, h, i}) = top + std::log(z);
        for (int64_t j = 0; j < s; ++j)
          for (int64_t c = 0; c < dv; ++c)
            out.at({bi, h, i, c}) += std::exp(score[size_t(j)] - top) / z * v.at({bi, kh, j, c});
      }
  return {out, lse};
}

double scale_for(const Ref& q) { return 1.0 / std::sqrt(double(q.shape[3])); }

V attend(const V& x, AttentionOptions o, bool with_lse = true) {
  const AttentionOutput r = scaled_dot_product_attention(x[0], x[1], x[2], o);
  return with_lse ? V{r.out, r.lse} : V{r.out};
}

Shape with_last(Shape s, int64_t last) {
  s.back() = last;
  return s;
}

}  // namespace

TEST_CASE("attention: output and lse match the float64 reference: causal or not, S != T, GQA, ragged tiles, T = 1") {
  struct Case {
    const char* name;
    Shape q, kv;
    int64_t dv;
    bool causal;
    std::optional<int64_t> offset;
  };
  const Case cases[] = {
      {"plain", {2, 2, 5, 8}, {2, 2, 5, 8}, 8, false, {}},
      {"causal over two query tiles", {1, 1, 70, 2}, {1, 1, 70, 2}, 3, true, {}},
      {"causal GQA, S > T", {1, 4, 3, 2}, {1, 2, 67, 2}, 2, true, {}},  // query i sees keys j <= i + 64
      {"GQA of 3, ragged tiles", {1, 3, 65, 2}, {1, 1, 130, 2}, 1, false, {}},
      {"T = 1", {2, 2, 1, 8}, {2, 2, 9, 8}, 8, true, {}},
      {"causal, explicit offset", {1, 2, 66, 2}, {1, 1, 80, 2}, 2, true, 5},
  };
  for (const Case& c : cases) {
    const AttentionOptions o{.causal = c.causal, .causal_offset = c.offset};
    const int64_t offset = c.offset.value_or(c.kv[2] - c.q[2]);
    const Sees sees = c.causal ? causal_sees(offset) : Sees([](int64_t, int64_t, int64_t) { return true; });
    run_op_case({.name = std::string("attention ") + c.name, .inputs = {{c.q}, {c.kv}, {with_last(c.kv, c.dv)}},
                 .op = [o](const V& x) { return attend(x, o); },
                 .ref = [sees](const R& r) { return attention_ref(r[0], r[1], r[2], scale_for(r[0]), sees); },
                 .lowp_tol = 4e-2});
  }
}

TEST_CASE("attention: document ids keep queries within their document, causal within it") {
  for (bool causal : {false, true}) {
    run_op_case({.name = causal ? "attention documents causal" : "attention documents",
                 .inputs = {{{2, 2, 70, 2}}, {{2, 1, 70, 2}}, {{2, 1, 70, 2}},
                            {{2, 70}, Gen::index, false, 3, DType::i32}},
                 .op = [causal](const V& x) { return attend(x, {.causal = causal, .document_ids = x[3]}); },
                 .ref = [causal](const R& r) {
                   return attention_ref(r[0], r[1], r[2], scale_for(r[0]), document_sees(r[3], r[3], causal, 0));
                 },
                 .lowp_tol = 4e-2});
  }
  // Keys with documents of their own (a KV cache, a ring step): S != T and an explicit offset.
  run_op_case({.name = "attention key documents",
               .inputs = {{{1, 2, 9, 2}}, {{1, 2, 75, 2}}, {{1, 2, 75, 2}},
                          {{1, 9}, Gen::index, false, 2, DType::i64}, {{1, 75}, Gen::index, false, 2, DType::i64}},
               .op = [](const V& x) {
                 return attend(x, {.causal = true, .causal_offset = 70, .document_ids = x[3], .key_document_ids = x[4]},
                               false);
               },
               .ref = [](const R& r) {
                 return R{attention_ref(r[0], r[1], r[2], scale_for(r[0]), document_sees(r[3], r[4], true, 70))[0]};
               },
               .lowp_tol = 4e-2});
}

TEST_CASE("attention: causal by position: random positions with ties, key positions, (T) positions, documents") {
  // Positions drawn with ties and gaps, so some queries see no key at all.
  auto pos_at = [](const Ref& p, int64_t b, int64_t i) { return p.dim() == 1 ? p.at({i}) : p.at({b, i}); };
  run_op_case({.name = "attention positions",
               .inputs = {{{2, 2, 70, 2}}, {{2, 1, 70, 2}}, {{2, 1, 70, 3}}, {{2, 70}, Gen::index, false, 90, DType::i32}},
               .op = [](const V& x) { return attend(x, {.causal = true, .positions = x[3]}); },
               .ref = [&](const R& r) {
                 return attention_ref(r[0], r[1], r[2], scale_for(r[0]), [&](int64_t b, int64_t i, int64_t j) {
                   return pos_at(r[3], b, j) <= pos_at(r[3], b, i);
                 });
               },
               .lowp_tol = 4e-2});
  run_op_case({.name = "attention (T) positions",
               .inputs = {{{2, 2, 66, 2}}, {{2, 2, 66, 2}}, {{2, 2, 66, 2}}, {{66}, Gen::index, false, 66, DType::i64}},
               .op = [](const V& x) { return attend(x, {.causal = true, .positions = x[3]}, false); },
               .ref = [&](const R& r) {
                 return R{attention_ref(r[0], r[1], r[2], scale_for(r[0]), [&](int64_t b, int64_t i, int64_t j) {
                   return pos_at(r[3], b, j) <= pos_at(r[3], b, i);
                 })[0]};
               },
               .lowp_tol = 4e-2});
  // A ring step: keys with positions of their own (S != T). A query may come before every key
  // (its output 0, its lse -inf, which finite differences cannot difference): outputs only.
  run_op_case({.name = "attention key positions",
               .inputs = {{{1, 2, 9, 2}}, {{1, 2, 75, 2}}, {{1, 2, 75, 2}}, {{1, 9}, Gen::index, false, 80, DType::i64},
                          {{75}, Gen::index, false, 80, DType::i32}},
               .op = [](const V& x) {
                 return attend(x, {.causal = true, .positions = x[3], .key_positions = x[4]}, false);
               },
               .ref = [&](const R& r) {
                 return R{attention_ref(r[0], r[1], r[2], scale_for(r[0]), [&](int64_t b, int64_t i, int64_t j) {
                   return pos_at(r[4], b, j) <= pos_at(r[3], b, i);
                 })[0]};
               },
               .lowp_tol = 4e-2});
  // Queries at 20..59 against keys at 0..39: each sees some keys (40 draws leave none at 20 or
  // below with probability (19/40)^40), many see only some; with the lse.
  run_op_case({.name = "attention key positions with lse",
               .inputs = {{{1, 2, 9, 2}}, {{1, 2, 40, 2}}, {{1, 2, 40, 2}}, {{1, 9}, Gen::index, false, 40, DType::i64},
                          {{40}, Gen::index, false, 40, DType::i32}},
               .op = [](const V& x) {
                 return attend(x, {.causal = true, .positions = x[3] + 20, .key_positions = x[4]});
               },
               .ref = [&](const R& r) {
                 return attention_ref(r[0], r[1], r[2], scale_for(r[0]), [&](int64_t b, int64_t i, int64_t j) {
                   return pos_at(r[4], b, j) <= pos_at(r[3], b, i) + 20;
                 });
               },
               .lowp_tol = 4e-2});
  // Packed rows: positions and documents together, both must allow a pair.
  run_op_case({.name = "attention positions and documents",
               .inputs = {{{2, 2, 70, 2}}, {{2, 1, 70, 2}}, {{2, 1, 70, 2}}, {{2, 70}, Gen::index, false, 3, DType::i32},
                          {{2, 70}, Gen::index, false, 70, DType::i32}},
               .op = [](const V& x) { return attend(x, {.causal = true, .document_ids = x[3], .positions = x[4]}); },
               .ref = [&](const R& r) {
                 return attention_ref(r[0], r[1], r[2], scale_for(r[0]), [&](int64_t b, int64_t i, int64_t j) {
                   return r[3].at({b, i}) == r[3].at({b, j}) && pos_at(r[4], b, j) <= pos_at(r[4], b, i);
                 });
               },
               .lowp_tol = 4e-2});
}

TEST_CASE("attention: a load-balanced token order with its positions gives the reordered causal result, same tiles") {
  // The context-parallel layout of 512 tokens over 2 ranks, both ranks' tokens in one call:
  // chunks of 128 in the order 0, 3, 1, 2.
  const int64_t t = 512, c = 128;
  std::vector<double> perm;
  for (int64_t chunk : {0, 3, 1, 2})
    for (int64_t i = 0; i < c; ++i) perm.push_back(double(chunk * c + i));
  const Tensor idx = from_vector(perm, {t}, {.dtype = DType::i64});
  const Tensor q0 = randn({1, 2, t, 8}, RngKey(11, "q"), {.dtype = DType::f64});
  const Tensor k0 = randn({1, 1, t, 8}, RngKey(11, "k"), {.dtype = DType::f64});
  const Tensor v0 = randn({1, 1, t, 8}, RngKey(11, "v"), {.dtype = DType::f64});
  const Tensor w = randn({1, 2, t, 8}, RngKey(11, "w"), {.dtype = DType::f64});
  Tensor q = q0.clone().set_requires_grad(), k = k0.clone().set_requires_grad(), v = v0.clone().set_requires_grad();
  const AttentionOutput plain = scaled_dot_product_attention(q, k, v, {.causal = true});
  sum(plain.out * w).backward();
  Tensor qp = index_select(q0, 2, idx).set_requires_grad(), kp = index_select(k0, 2, idx).set_requires_grad(),
         vp = index_select(v0, 2, idx).set_requires_grad();
  const AttentionOutput moved = scaled_dot_product_attention(qp, kp, vp, {.causal = true, .positions = idx});
  sum(moved.out * index_select(w, 2, idx)).backward();
  CHECK(max_abs_diff(moved.out, index_select(plain.out, 2, idx)) < 1e-12);
  CHECK(max_abs_diff(moved.lse, index_select(plain.lse, 2, idx)) < 1e-12);
  CHECK(max_abs_diff(qp.grad(), index_select(q.grad(), 2, idx)) < 1e-12);
  CHECK(max_abs_diff(kp.grad(), index_select(k.grad(), 2, idx)) < 1e-12);
  CHECK(max_abs_diff(vp.grad(), index_select(v.grad(), 2, idx)) < 1e-12);
  // Chunks are whole tiles, so the kernel computes as many tiles as for the plain causal order:
  // 36 of the 8 x 8, per head.
  std::vector<int32_t> pos32(perm.begin(), perm.end());
  const kernels::cpu::AttentionArgs a{.batch = 1, .q_heads = 2, .kv_heads = 1, .t = t, .s = t, .d = 8, .dv = 8,
                                      .causal = true, .q_pos = pos32.data(), .k_pos = pos32.data()};
  kernels::cpu::AttentionArgs by_index = a;
  by_index.q_pos = by_index.k_pos = nullptr;
  CHECK(kernels::cpu::attention_forward_pairs(a) == 2 * 36 * 64 * 64);
  CHECK(kernels::cpu::attention_forward_pairs(by_index) == 2 * 36 * 64 * 64);
}

TEST_CASE("attention: cu_seqlens give the same result as the document ids they describe") {
  const Tensor q = randn({2, 2, 100, 8}, RngKey(3, "q")), k = randn({2, 2, 100, 8}, RngKey(3, "k")),
               v = randn({2, 2, 100, 8}, RngKey(3, "v"));
  std::vector<double> ids;
  for (int64_t i = 0; i < 100; ++i) ids.push_back(i < 30 ? 0 : i < 31 ? 1 : i < 90 ? 2 : 3);
  const Tensor doc = expand(from_vector(ids, {1, 100}, {.dtype = DType::i64}), {2, 100});
  const Tensor cu = from_vector({0, 30, 31, 90, 100}, {5}, {.dtype = DType::i32});
  const AttentionOutput a = scaled_dot_product_attention(q, k, v, {.causal = true, .document_ids = doc});
  const AttentionOutput b = scaled_dot_product_attention(q, k, v, {.causal = true, .cu_seqlens = cu});
  CHECK(max_abs_diff(a.out, b.out) == 0.0);
  CHECK(max_abs_diff(a.lse, b.lse) == 0.0);
}

TEST_CASE("attention: a query that sees no key gets zeros, lse -inf and no gradient") {
  // Causal with S < T: queries 0..3 come before every key; offset -70 hides more than a tile.
  for (int64_t offset : {-4, -70}) {
    run_op_case({.name = "attention empty rows offset " + std::to_string(offset),
                 .inputs = {{{1, 2, 75, 2}}, {{1, 1, 75, 2}}, {{1, 1, 75, 2}}},
                 .op = [offset](const V& x) { return attend(x, {.causal = true, .causal_offset = offset}, false); },
                 .ref = [offset](const R& r) {
                   return R{attention_ref(r[0], r[1], r[2], scale_for(r[0]), causal_sees(offset))[0]};
                 },
                 .lowp_tol = 4e-2});
  }
  Tensor q = randn({1, 1, 6, 4}, RngKey(4, "q"), {.requires_grad = true});
  Tensor k = randn({1, 1, 2, 4}, RngKey(4, "k"), {.requires_grad = true});
  Tensor v = randn({1, 1, 2, 4}, RngKey(4, "v"), {.requires_grad = true});
  const AttentionOutput r = scaled_dot_product_attention(q, k, v, {.causal = true});  // rows 0..3 see nothing
  const std::vector<double> out = r.out.to_vector(), lse = r.lse.to_vector();
  for (size_t i = 0; i < 16; ++i) CHECK(out[i] == 0.0);
  for (size_t i = 0; i < 4; ++i) CHECK(lse[i] == -kInf);
  CHECK(std::isfinite(lse[4]));
  // A gradient on the empty rows alone reaches nothing.
  std::vector<double> g(24, 0.0);
  for (size_t i = 0; i < 16; ++i) g[i] = 1.0;
  r.out.backward(from_vector(g, {1, 1, 6, 4}));
  for (const Tensor* t : {&q, &k, &v})
    for (double x : t->grad().to_vector()) CHECK(x == 0.0);
}

TEST_CASE("attention: bf16 is computed in f32 and rounded once") {
  const Tensor q = randn({1, 2, 150, 64}, RngKey(5, "q"), {.dtype = DType::bf16});
  const Tensor k = randn({1, 2, 150, 64}, RngKey(5, "k"), {.dtype = DType::bf16});
  const Tensor v = randn({1, 2, 150, 64}, RngKey(5, "v"), {.dtype = DType::bf16});
  const AttentionOutput lo = scaled_dot_product_attention(q, k, v, {.causal = true});
  const AttentionOutput hi =
      scaled_dot_product_attention(cast(q, DType::f32), cast(k, DType::f32), cast(v, DType::f32), {.causal = true});
  CHECK(lo.out.dtype() == DType::bf16);
  CHECK(lo.lse.dtype() == DType::f32);
  CHECK(max_abs_diff(lo.lse, hi.lse) < 1e-5);  // the same f32 computation on the widened inputs
  // Within half a bf16 ulp (|x| / 256) of the exact result: one rounding, at the end.
  const R want = attention_ref(Ref::of(q), Ref::of(k), Ref::of(v), 0.125, causal_sees(0));
  const std::vector<double> got = lo.out.to_vector();
  for (size_t i = 0; i < got.size(); ++i) REQUIRE(std::abs(got[i] - want[0].v[i]) <= std::abs(want[0].v[i]) / 256 + 1e-5);
}

TEST_CASE("attention: the primitive agrees with the composite it replaced, gradients of out and lse included") {
  const Tensor q0 = randn({2, 4, 70, 8}, RngKey(6, "q"), {.dtype = DType::f64});
  const Tensor k0 = randn({2, 2, 90, 8}, RngKey(6, "k"), {.dtype = DType::f64});
  const Tensor v0 = randn({2, 2, 90, 5}, RngKey(6, "v"), {.dtype = DType::f64});
  const Tensor qd = randint(0, 2, {2, 70}, RngKey(6, "qd")), kd = randint(0, 2, {2, 90}, RngKey(6, "kd"));
  auto run = [&](bool composite) {
    Tensor q = q0.clone().set_requires_grad(), k = k0.clone().set_requires_grad(), v = v0.clone().set_requires_grad();
    const AttentionOutput r = scaled_dot_product_attention(
        q, k, v, {.causal = true, .document_ids = qd, .key_document_ids = kd, .composite = composite});
    // Weights on out and on the finite lse entries (rows that see nothing have none).
    const Tensor w = randn(r.out.shape(), RngKey(6, "w"), {.dtype = DType::f64});
    const Tensor lse = where(gt(r.lse, scalar_like(-1e300, r.lse)), r.lse, zeros({}, {.dtype = DType::f64}));
    (sum(r.out * w) + sum(lse * 0.3)).backward();
    return std::vector<Tensor>{r.out, r.lse, q.grad(), k.grad(), v.grad()};
  };
  const std::vector<Tensor> want = run(true);
  // One thread: each task owns a kv head (4 of them); 16: key blocks, then query blocks.
  const int threads = omp_get_max_threads();
  std::vector<Tensor> got[2];
  for (int i : {0, 1}) {
    omp_set_num_threads(i == 0 ? 1 : 16);
    got[i] = run(false);
  }
  omp_set_num_threads(threads);
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("result ", i);
    CHECK(max_abs_diff(got[0][i], want[i]) < 1e-12);
    CHECK(max_abs_diff(got[0][i], got[1][i]) == 0.0);  // the same sums in the same order
  }
}

TEST_CASE("attention: forward and backward at T = 2048 keep no (T, T) matrix") {
  const int64_t t = 2048, d = 64;
  Tensor q = randn({1, 1, t, d}, RngKey(7, "q"), {.requires_grad = true});
  Tensor k = randn({1, 1, t, d}, RngKey(7, "k"), {.requires_grad = true});
  Tensor v = randn({1, 1, t, d}, RngKey(7, "v"), {.requires_grad = true});
  const Tensor g = randn({1, 1, t, d}, RngKey(7, "g"));
  reset_cpu_peak_memory();
  const int64_t base = cpu_memory_stats().allocated;
  {
    const AttentionOutput r = scaled_dot_product_attention(q, k, v, {.causal = true});
    r.out.backward(g);
  }
  const int64_t peak = cpu_memory_stats().peak_allocated - base;
  MESSAGE("peak host memory of forward + backward: ", peak, " bytes (one (T, T) f32 matrix: ", t * t * 4, ")");
  CHECK(peak < t * t * 4 / 4);
  CHECK(q.grad().defined());
}

TEST_CASE("attention: errors name the shapes") {
  const Tensor q = zeros({1, 2, 5, 4}), k = zeros({1, 2, 5, 4}), v = zeros({1, 2, 5, 4});
  auto sdpa = [&](const Tensor& a, const Tensor& b, const Tensor& c, AttentionOptions o = {}) {
    return scaled_dot_product_attention(a, b, c, o);
  };
  CHECK_THROWS_WITH_AS(sdpa(zeros({2, 5, 4}), k, v), doctest::Contains("q, k, v must be (B, H, T, D), got (2, 5, 4)"),
                       Error);
  CHECK_THROWS_WITH_AS(sdpa(zeros({1, 3, 5, 4}), k, v),
                       doctest::Contains("query heads (3) must be a multiple of key/value heads (2)"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, zeros({1, 1, 5, 4})), doctest::Contains("differ in heads or length"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, zeros({1, 2, 5, 3}), v), doctest::Contains("q and k head dims differ"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.document_ids = zeros({1, 4}, {.dtype = DType::i32})}),
                       doctest::Contains("document_ids must be (B, T) = (1, 5), got (1, 4)"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.document_ids = zeros({1, 5})}),
                       doctest::Contains("document_ids must be i32 or i64, got f32"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, zeros({1, 2, 6, 4}), zeros({1, 2, 6, 4}),
                            {.document_ids = zeros({1, 5}, {.dtype = DType::i32})}),
                       doctest::Contains("give key_document_ids (B, S)"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.key_document_ids = zeros({1, 5}, {.dtype = DType::i32})}),
                       doctest::Contains("key_document_ids need the queries' document_ids or cu_seqlens"), Error);
  const Tensor cu = from_vector({0, 2, 4}, {3}, {.dtype = DType::i32});
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.cu_seqlens = cu}),
                       doctest::Contains("cu_seqlens must run from 0 to T = 5, got 0 to 4"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.cu_seqlens = from_vector({0, 3, 2, 5}, {4}, {.dtype = DType::i32})}),
                       doctest::Contains("cu_seqlens must not decrease, got 3 before 2"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.document_ids = zeros({1, 5}, {.dtype = DType::i32}), .cu_seqlens = cu}),
                       doctest::Contains("give document_ids or cu_seqlens, not both"), Error);
  const Tensor pos = arange(0, 5, 1, {.dtype = DType::i32});
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.positions = pos}),
                       doctest::Contains("positions mask causally: give them with causal = true"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.causal = true, .positions = zeros({2, 5}, {.dtype = DType::i32})}),
                       doctest::Contains("positions must be (T) or (B, T) = (5) or (1, 5), got (2, 5)"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.causal = true, .positions = zeros({5})}),
                       doctest::Contains("positions must be i32 or i64, got f32"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, k, v, {.causal = true, .key_positions = pos}),
                       doctest::Contains("key_positions need the queries' positions"), Error);
  CHECK_THROWS_WITH_AS(sdpa(q, zeros({1, 2, 6, 4}), zeros({1, 2, 6, 4}), {.causal = true, .positions = pos}),
                       doctest::Contains("give key_positions (S) or (B, S)"), Error);
}

TEST_CASE("attention: heads or batch sharded stay sharded, and agree with one process") {
  // A head cut that would split a GQA group (2 kv heads on 4 ranks) is not kept; 3 heads
  // without groups are, unevenly (one rank holds none).
  run_threads_group(4, [](Communicator& c) {
    const DeviceMesh mesh = mesh_of_shape(c, {4});
    for (auto [hq, hkv, kept] : {std::tuple{4, 2, false}, {3, 3, true}}) {
      const Tensor q = randn({1, hq, 5, 4}, RngKey(9, "q"), {.dtype = DType::f64});
      const Tensor k = randn({1, hkv, 5, 4}, RngKey(9, "k"), {.dtype = DType::f64});
      const Tensor v = randn({1, hkv, 5, 4}, RngKey(9, "v"), {.dtype = DType::f64});
      const AttentionOutput want = scaled_dot_product_attention(q, k, v, {.causal = true});
      const Placements pl{Shard(1)};
      const AttentionOutput got = scaled_dot_product_attention(
          distribute_tensor(q, mesh, pl), distribute_tensor(k, mesh, pl), distribute_tensor(v, mesh, pl), {.causal = true});
      CHECK((placements_of(got.out) == pl) == kept);
      CHECK(max_abs_diff(full_tensor(got.out), want.out) < 1e-12);
    }
  });
  run_threads_group(4, [](Communicator& c) {
    const DeviceMesh mesh = mesh_of_shape(c, {2, 2});
    const Tensor q0 = randn({2, 4, 7, 4}, RngKey(8, "q"), {.dtype = DType::f64});
    const Tensor k0 = randn({2, 2, 7, 4}, RngKey(8, "k"), {.dtype = DType::f64});
    const Tensor v0 = randn({2, 2, 7, 3}, RngKey(8, "v"), {.dtype = DType::f64});
    const Tensor doc = randint(0, 2, {2, 7}, RngKey(8, "doc"));
    const AttentionOptions o{.causal = true, .document_ids = doc};
    const AttentionOutput want = scaled_dot_product_attention(q0, k0, v0, o);
    Tensor qg = q0.clone().set_requires_grad(), kg = k0.clone().set_requires_grad(), vg = v0.clone().set_requires_grad();
    sum(scaled_dot_product_attention(qg, kg, vg, o).out * 1.5).backward();
    // a0 cuts the batch (data parallel), a1 the heads (tensor parallel; 2 kv heads on 2 ranks).
    const Placements pl{Shard(0), Shard(1)};
    Tensor q = distribute_tensor(q0, mesh, pl).set_requires_grad(), k = distribute_tensor(k0, mesh, pl).set_requires_grad(),
           v = distribute_tensor(v0, mesh, pl).set_requires_grad();
    const AttentionOutput got = scaled_dot_product_attention(q, k, v, o);
    CHECK(placements_of(got.out) == pl);
    CHECK(placements_of(got.lse) == pl);
    CHECK(max_abs_diff(full_tensor(got.out), want.out) < 1e-12);
    CHECK(max_abs_diff(full_tensor(got.lse), want.lse) < 1e-12);
    sum(got.out * 1.5).backward();
    for (auto [dist, plain] : {std::pair{&q, &qg}, {&k, &kg}, {&v, &vg}}) {
      CHECK(placements_of(dist->grad()) == pl);
      CHECK(max_abs_diff(full_tensor(dist->grad()), plain->grad()) < 1e-12);
    }
  });
}
