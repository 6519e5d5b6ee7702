// Scaled dot-product attention, a composite of other ops (matmul, softmax, where, views), so it
// needs no backward of its own and runs on every device those ops run on. A fused (flash)
// attention kernel would become a primitive beside it. (rotary_embedding is in nn.cpp.)
#include <cmath>
#include <limits>

#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/matmul.h"
#include "engine/ops/nn.h"
#include "engine/ops/reduce.h"
#include "engine/ops/unary.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"

namespace quilt {
namespace {

// (T, S) bool: query i may see key j iff j <= i + (S - T), so the last query sees every key.
Tensor causal_mask(int64_t t, int64_t s, Device device) {
  const Tensor i = reshape(arange(0, double(t), 1, {.dtype = DType::i64, .device = device}), {t, 1});
  const Tensor j = reshape(arange(0, double(s), 1, {.dtype = DType::i64, .device = device}), {1, s});
  return le(j, i + double(s - t));
}

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                                    std::optional<double> scale) {
  QUILT_CHECK(q.defined() && k.defined() && v.defined(), "[scaled_dot_product_attention] got an undefined tensor");
  QUILT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "[scaled_dot_product_attention] q, k, v must be (B, H, T, D), got ", q.shape(), ", ", k.shape(), ", ",
              v.shape());
  QUILT_CHECK(is_floating(q.dtype()) && q.dtype() == k.dtype() && q.dtype() == v.dtype(),
              "[scaled_dot_product_attention] q, k, v must share one floating dtype, got ", dtype_name(q.dtype()),
              ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  const int64_t b = q.size(0), hq = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), s = k.size(2), dv = v.size(3);
  QUILT_CHECK(k.size(0) == b && v.size(0) == b, "[scaled_dot_product_attention] batch sizes differ: q ", q.shape(),
              ", k ", k.shape(), ", v ", v.shape());
  QUILT_CHECK(k.size(3) == d, "[scaled_dot_product_attention] q and k head dims differ: q ", q.shape(), ", k ",
              k.shape());
  QUILT_CHECK(v.size(1) == hkv && v.size(2) == s, "[scaled_dot_product_attention] k ", k.shape(), " and v ",
              v.shape(), " differ in heads or length");
  QUILT_CHECK(hkv > 0 && hq % hkv == 0, "[scaled_dot_product_attention] query heads (", hq,
              ") must be a multiple of key/value heads (", hkv, ")");
  const Shape full{b, hq, t, s};
  if (mask.defined()) {
    QUILT_CHECK(mask.dtype() == DType::b8, "[scaled_dot_product_attention] mask must be bool (true = attend), got ",
                dtype_name(mask.dtype()));
    QUILT_CHECK(ops::broadcasts_to(mask.shape(), full), "[scaled_dot_product_attention] mask of shape ", mask.shape(),
                " does not broadcast to (B, Hq, T, S) = ", full);
  }
  const Device dev = common_device("scaled_dot_product_attention", {q, k, v, mask});
  const double sc = scale.value_or(d > 0 ? 1.0 / std::sqrt(double(d)) : 1.0);
  const int64_t g = hq / hkv;

  // Grouped heads: q as (B, Hkv, G, T, D) against k as (B, Hkv, 1, D, S); matmul broadcasts
  // the kv head over its G query heads, so k and v are never copied per query head.
  const Tensor qg = reshape(sc == 1.0 ? q : q * sc, {b, hkv, g, t, d});
  Tensor scores = reshape(matmul(qg, unsqueeze(transpose(k, -1, -2), 2)), full);

  Tensor allowed = mask;
  if (causal) {
    const Tensor cm = causal_mask(t, s, dev);
    allowed = allowed.defined() ? logical_and(allowed, cm) : cm;
  }
  Tensor p;
  if (!allowed.defined()) {
    p = softmax(scores, -1);
  } else {
    scores = where(allowed, scores, scalar_like(-std::numeric_limits<double>::infinity(), scores));
    // Without a user mask, causal rows are empty only when S < T (query i < T - S sees nothing).
    if (mask.defined() || s < t) {
      // A row that sees no key would be softmax(-inf, ...) = NaN: give it finite scores, then zero
      // its probabilities, so its output and every gradient through it are 0.
      const Tensor seen = sum(cast(allowed, DType::i32), {-1}, true);  // keys each query may see
      const Tensor any = gt(seen, scalar_like(0, seen));
      const Tensor zero = zeros({}, {.dtype = scores.dtype(), .device = dev});
      p = where(any, softmax(where(any, scores, zero), -1), zero);
    } else {
      p = softmax(scores, -1);
    }
  }
  const Tensor out = matmul(reshape(p, {b, hkv, g, t, s}), unsqueeze(v, 2));  // (B, Hkv, G, T, Dv)
  return reshape(out, {b, hq, t, dv});
}

}  // namespace quilt
