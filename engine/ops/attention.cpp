// Scaled dot-product attention. On CPU tensors (local or distributed) it is a primitive with a
// fused flash-style kernel (kernels/cpu/attention.h) that returns the output and each query's
// log-sum-exp, and whose backward recomputes the probabilities from them, so no (T, S) matrix
// is kept. CUDA tensors take the same primitive with the CUDA kernels (kernels/cuda/attention.h)
// where those support the dtype and head dims (f32/bf16/f16, D = Dv of 64 or 128). A bool mask
// tensor, other CUDA calls and AttentionOptions::composite take the composite of matmul,
// softmax and where, which runs wherever those ops do. Sharding rules:
// dtensor/rules/attention.cpp. (rotary_embedding is in nn.cpp.)
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
#include "kernels/cpu/attention.h"
#include "kernels/cpu/nn.h"
#include "kernels/cuda/attention.h"

namespace quilt {
namespace {

using kernels::cpu::stat_dtype;
constexpr double kInf = std::numeric_limits<double>::infinity();

// The sizes of one call, checked: q (B, Hq, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv).
struct Dims {
  int64_t b, hq, hkv, t, s, d, dv;
};

Dims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  QUILT_CHECK(q.defined() && k.defined() && v.defined(), "[scaled_dot_product_attention] got an undefined tensor");
  QUILT_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "[scaled_dot_product_attention] q, k, v must be (B, H, T, D), got ", q.shape(), ", ", k.shape(), ", ",
              v.shape());
  QUILT_CHECK(is_floating(q.dtype()) && q.dtype() == k.dtype() && q.dtype() == v.dtype(),
              "[scaled_dot_product_attention] q, k, v must share one floating dtype, got ", dtype_name(q.dtype()),
              ", ", dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  const Dims n{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  QUILT_CHECK(k.size(0) == n.b && v.size(0) == n.b, "[scaled_dot_product_attention] batch sizes differ: q ",
              q.shape(), ", k ", k.shape(), ", v ", v.shape());
  QUILT_CHECK(k.size(3) == n.d, "[scaled_dot_product_attention] q and k head dims differ: q ", q.shape(), ", k ",
              k.shape());
  QUILT_CHECK(v.size(1) == n.hkv && v.size(2) == n.s, "[scaled_dot_product_attention] k ", k.shape(), " and v ",
              v.shape(), " differ in heads or length");
  QUILT_CHECK(n.hkv > 0 && n.hq % n.hkv == 0, "[scaled_dot_product_attention] query heads (", n.hq,
              ") must be a multiple of key/value heads (", n.hkv, ")");
  return n;
}

// (B, n) document ids as i32, checked against the expected shape.
Tensor doc_ids(const Tensor& ids, const char* what, int64_t b, int64_t n, const char* dims) {
  QUILT_CHECK(ids.dtype() == DType::i32 || ids.dtype() == DType::i64, "[scaled_dot_product_attention] ", what,
              " must be i32 or i64, got ", dtype_name(ids.dtype()));
  QUILT_CHECK(ids.dim() == 2 && ids.size(0) == b && ids.size(1) == n, "[scaled_dot_product_attention] ", what,
              " must be ", dims, " = ", Shape{b, n}, ", got ", ids.shape());
  return ids.dtype() == DType::i32 ? ids : cast(ids, DType::i32);
}

// Per-token document ids (B, T) from cu_seqlens (N + 1): token i belongs to document r when
// cu[r] <= i < cu[r + 1].
Tensor ids_from_cu_seqlens(const Tensor& cu, int64_t b, int64_t t) {
  QUILT_CHECK(cu.dtype() == DType::i32 || cu.dtype() == DType::i64,
              "[scaled_dot_product_attention] cu_seqlens must be i32 or i64, got ", dtype_name(cu.dtype()));
  QUILT_CHECK(cu.dim() == 1 && cu.size(0) >= 1, "[scaled_dot_product_attention] cu_seqlens must be (N + 1), got ",
              cu.shape());
  const std::vector<double> c = cu.to_vector();
  QUILT_CHECK(c.front() == 0 && c.back() == double(t), "[scaled_dot_product_attention] cu_seqlens must run from 0 to T = ",
              t, ", got ", c.front(), " to ", c.back());
  std::vector<double> ids(static_cast<size_t>(t));
  for (size_t r = 0; r + 1 < c.size(); ++r) {
    QUILT_CHECK(c[r] <= c[r + 1], "[scaled_dot_product_attention] cu_seqlens must not decrease, got ", c[r],
                " before ", c[r + 1]);
    for (int64_t i = int64_t(c[r]); i < int64_t(c[r + 1]); ++i) ids[size_t(i)] = double(r);
  }
  return expand(from_vector(ids, {1, t}, {.dtype = DType::i32, .device = cu.device()}), {b, t});
}

// The queries' and keys' document ids (B, T) and (B, S) as i32, or two undefined tensors.
std::pair<Tensor, Tensor> documents(const AttentionOptions& o, const Dims& n) {
  QUILT_CHECK(!(o.document_ids.defined() && o.cu_seqlens.defined()),
              "[scaled_dot_product_attention] give document_ids or cu_seqlens, not both");
  QUILT_CHECK(!o.key_document_ids.defined() || o.document_ids.defined() || o.cu_seqlens.defined(),
              "[scaled_dot_product_attention] key_document_ids need the queries' document_ids or cu_seqlens");
  Tensor qd;
  if (o.document_ids.defined()) qd = doc_ids(o.document_ids, "document_ids", n.b, n.t, "(B, T)");
  else if (o.cu_seqlens.defined()) qd = ids_from_cu_seqlens(o.cu_seqlens, n.b, n.t);
  if (!qd.defined()) return {};
  if (o.key_document_ids.defined()) return {qd, doc_ids(o.key_document_ids, "key_document_ids", n.b, n.s, "(B, S)")};
  QUILT_CHECK(n.s == n.t, "[scaled_dot_product_attention] keys (S = ", n.s, ") and queries (T = ", n.t,
              ") differ in length: give key_document_ids (B, S)");
  return {qd, qd};
}

// (B, n) positions as i32 from (n) or (B, n), checked.
Tensor position_ids(const Tensor& p, const char* what, int64_t b, int64_t n, const char* dims) {
  QUILT_CHECK(p.dtype() == DType::i32 || p.dtype() == DType::i64, "[scaled_dot_product_attention] ", what,
              " must be i32 or i64, got ", dtype_name(p.dtype()));
  QUILT_CHECK((p.dim() == 1 && p.size(0) == n) || (p.dim() == 2 && p.size(0) == b && p.size(1) == n),
              "[scaled_dot_product_attention] ", what, " must be ", dims, " = (", n, ") or ", Shape{b, n}, ", got ",
              p.shape());
  const Tensor p2 = p.dim() == 1 ? expand(reshape(p, {1, n}), {b, n}) : p;
  return p2.dtype() == DType::i32 ? p2 : cast(p2, DType::i32);
}

// The queries' and keys' positions (B, T) and (B, S) as i32, or two undefined tensors.
std::pair<Tensor, Tensor> positions(const AttentionOptions& o, const Dims& n) {
  QUILT_CHECK(!o.key_positions.defined() || o.positions.defined(),
              "[scaled_dot_product_attention] key_positions need the queries' positions");
  if (!o.positions.defined()) return {};
  QUILT_CHECK(o.causal, "[scaled_dot_product_attention] positions mask causally: give them with causal = true");
  const Tensor qp = position_ids(o.positions, "positions", n.b, n.t, "(T) or (B, T)");
  if (o.key_positions.defined()) return {qp, position_ids(o.key_positions, "key_positions", n.b, n.s, "(S) or (B, S)")};
  QUILT_CHECK(n.s == n.t, "[scaled_dot_product_attention] keys (S = ", n.s, ") and queries (T = ", n.t,
              ") differ in length: give key_positions (S) or (B, S)");
  return {qp, qp};
}

// (T, S) bool: query i may see key j iff j <= i + offset.
Tensor causal_mask(int64_t t, int64_t s, int64_t offset, Device device) {
  const Tensor i = reshape(arange(0, double(t), 1, {.dtype = DType::i64, .device = device}), {t, 1});
  const Tensor j = reshape(arange(0, double(s), 1, {.dtype = DType::i64, .device = device}), {1, s});
  return le(j, i + double(offset));
}

// The composite: the (B, Hq, T, S) scores masked by `mask` (bool, broadcast to them), the
// causal mask and the documents, then softmax and the product with v. Returns the output and,
// when asked, the log-sum-exp (B, Hq, T) in stat_dtype.
AttentionOutput composite(const Tensor& q, const Tensor& k, const Tensor& v, const Dims& n, Tensor allowed,
                          bool causal, int64_t offset, double sc, const std::pair<Tensor, Tensor>& docs,
                          const std::pair<Tensor, Tensor>& pos, bool want_lse) {
  const Device dev = q.device();
  const int64_t g = n.hq / n.hkv;
  const Shape full{n.b, n.hq, n.t, n.s};
  auto both = [&](const Tensor& m) { return allowed.defined() ? logical_and(allowed, m) : m; };
  const bool user_mask = allowed.defined();
  if (causal && pos.first.defined())  // (B, 1, T, S): key_positions[j] <= positions[i]
    allowed = both(unsqueeze(le(unsqueeze(pos.second, 1), unsqueeze(pos.first, 2)), 1));
  else if (causal)
    allowed = both(causal_mask(n.t, n.s, offset, dev));
  if (docs.first.defined()) allowed = both(unsqueeze(eq(unsqueeze(docs.first, 2), unsqueeze(docs.second, 1)), 1));

  // Grouped heads: q as (B, Hkv, G, T, D) against k as (B, Hkv, 1, D, S); matmul broadcasts
  // the kv head over its G query heads, so k and v are never copied per query head.
  const Tensor qg = reshape(sc == 1.0 ? q : q * sc, {n.b, n.hkv, g, n.t, n.d});
  Tensor scores = reshape(matmul(qg, unsqueeze(transpose(k, -1, -2), 2)), full);
  // Rows can be empty with a user mask, documents, positions or a causal offset below 0 (S < T when
  // aligned at the end).
  Tensor any;
  if (allowed.defined()) {
    scores = where(allowed, scores, scalar_like(-kInf, scores));
    if (user_mask || docs.first.defined() || pos.first.defined() || offset < 0) {
      const Tensor seen = sum(cast(allowed, DType::i32), {-1}, true);  // keys each query may see
      any = expand(gt(seen, scalar_like(0, seen)), {n.b, n.hq, n.t, 1});
      // A row that sees no key would be softmax(-inf, ...) = NaN: give it finite scores, then zero
      // its probabilities, so its output and every gradient through it are 0.
      scores = where(any, scores, zeros({}, {.dtype = scores.dtype(), .device = dev}));
    }
  }
  Tensor p = softmax(scores, -1);
  if (any.defined()) p = where(any, p, zeros({}, {.dtype = p.dtype(), .device = dev}));
  const Tensor out = matmul(reshape(p, {n.b, n.hkv, g, n.t, n.s}), unsqueeze(v, 2));  // (B, Hkv, G, T, Dv)
  AttentionOutput r{reshape(out, {n.b, n.hq, n.t, n.dv}), Tensor()};
  if (!want_lse) return r;
  // lse = m + log(sum(exp(s - m))) with m the row max (held fixed: lse does not depend on it);
  // empty rows get -inf, and log(1) inside so that no gradient through them is NaN.
  const Tensor m = max(scores, {-1}, true).detach();
  Tensor total = sum(exp(scores - m), {-1}, true);
  if (any.defined()) total = where(any, total, scalar_like(1, total));
  Tensor lse = squeeze(m + log(total), -1);
  if (any.defined()) lse = where(squeeze(any, -1), lse, scalar_like(-kInf, lse));
  r.lse = cast(lse, stat_dtype(q.dtype()));
  return r;
}

// Attributes shared by the forward and backward primitives (what the sharding rules read).
struct Config {
  bool causal;
  double scale;
  int64_t offset;
  bool docs;
  bool pos;
  Attrs attrs() const {
    return {{"causal", causal}, {"scale", scale}, {"causal_offset", offset}, {"documents", docs}, {"positions", pos}};
  }
};

// The kernel's arguments; `extra` are the inputs after q, k, v: [q_doc, k_doc], [q_pos, k_pos].
kernels::cpu::AttentionArgs kernel_args(const Tensor& q, const Tensor& k, const Tensor& v, const Config& cfg,
                                        const Tensor* extra) {
  const Tensor* pos = cfg.docs ? extra + 2 : extra;
  return {.batch = q.size(0), .q_heads = q.size(1), .kv_heads = k.size(1), .t = q.size(2), .s = k.size(2),
          .d = q.size(3), .dv = v.size(3), .scale = cfg.scale, .causal = cfg.causal, .causal_offset = cfg.offset,
          .q_doc = cfg.docs ? extra[0].data<int32_t>() : nullptr,
          .k_doc = cfg.docs ? extra[1].data<int32_t>() : nullptr,
          .q_pos = cfg.pos ? pos[0].data<int32_t>() : nullptr,
          .k_pos = cfg.pos ? pos[1].data<int32_t>() : nullptr};
}

// The inputs as contiguous tensors, as the kernels take them.
std::vector<Tensor> contiguous_all(const std::vector<Tensor>& in) {
  std::vector<Tensor> out;
  for (const Tensor& t : in) out.push_back(contiguous(t.detach()));
  return out;
}

// (dO, dlse, q, k, v, out, lse, [q_doc, k_doc], [q_pos, k_pos]) -> (dq, dk, dv). Not differentiable itself.
class SdpaBackward final : public Primitive {
 public:
  explicit SdpaBackward(Config cfg) : cfg_(cfg) {}
  const char* name() const override { return "scaled_dot_product_attention_backward"; }
  Attrs attrs() const override { return cfg_.attrs(); }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    const Tensor &d_out = b.x[0], &q = b.x[2], &k = b.x[3], &v = b.x[4], &out = b.x[5], &lse = b.x[6];
    kernels::cpu::attention_backward(q.dtype(), b.args, b.dq.data_ptr(), b.dk.data_ptr(), b.dv.data_ptr(),
                                     d_out.data_ptr(), b.dlse, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                     out.data_ptr(), lse.data_ptr());
    return {b.dq, b.dk, b.dv};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    const Tensor &d_out = b.x[0], &q = b.x[2], &k = b.x[3], &v = b.x[4], &out = b.x[5], &lse = b.x[6];
    kernels::cuda::attention_backward(q.dtype(), b.args, b.dq.data_ptr(), b.dk.data_ptr(), b.dv.data_ptr(),
                                      d_out.data_ptr(), b.dlse, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                      out.data_ptr(), lse.data_ptr(), ops::stream_handle(q.device()));
    return {b.dq, b.dk, b.dv};
  }

 private:
  // The inputs as the kernels read them (contiguous), their arguments and the gradients they write.
  struct Buffers {
    std::vector<Tensor> x;
    Tensor dq, dk, dv;
    kernels::cpu::AttentionArgs args;
    const void* dlse;
  };
  Buffers buffers(const std::vector<Tensor>& in) const {
    Buffers b;
    b.x = contiguous_all(in);
    const Tensor &q = b.x[2], &k = b.x[3], &v = b.x[4];
    b.dq = Tensor::empty(q.shape(), {.dtype = q.dtype(), .device = q.device()});
    b.dk = Tensor::empty(k.shape(), {.dtype = k.dtype(), .device = q.device()});
    b.dv = Tensor::empty(v.shape(), {.dtype = v.dtype(), .device = q.device()});
    b.args = kernel_args(q, k, v, cfg_, b.x.data() + 7);
    b.dlse = b.x[1].defined() ? b.x[1].data_ptr() : nullptr;
    return b;
  }

  Config cfg_;
};

// (q, k, v, [q_doc, k_doc], [q_pos, k_pos]) -> (out, lse); lse carries a gradient too (merging partial
// attention outputs by their lse differentiates through it).
class Sdpa final : public Primitive {
 public:
  explicit Sdpa(Config cfg) : cfg_(cfg) {}
  const char* name() const override { return "scaled_dot_product_attention"; }
  Attrs attrs() const override { return cfg_.attrs(); }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    const Tensor &q = b.x[0], &k = b.x[1], &v = b.x[2];
    kernels::cpu::attention_forward(q.dtype(), b.args, b.out.data_ptr(), b.lse.data_ptr(), q.data_ptr(), k.data_ptr(),
                                    v.data_ptr());
    return {b.out, b.lse};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    const Tensor &q = b.x[0], &k = b.x[1], &v = b.x[2];
    kernels::cuda::attention_forward(q.dtype(), b.args, b.out.data_ptr(), b.lse.data_ptr(), q.data_ptr(),
                                     k.data_ptr(), v.data_ptr(), ops::stream_handle(q.device()));
    return {b.out, b.lse};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>& out) override {
    saved_.clear();
    for (const Tensor& t : in) saved_.push_back(t.detach());
    saved_.push_back(out[0].detach());
    saved_.push_back(out[1].detach());
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const size_t n_in = saved_.size() - 2;
    auto as = [](const Tensor& g, DType dt) { return g.dtype() == dt ? g : cast(g, dt); };
    std::vector<Tensor> in{as(ctx.grads[0], ctx.inputs[0].dtype), as(ctx.grads[1], ctx.outputs[1].dtype),
                           saved_[0], saved_[1], saved_[2], saved_[n_in], saved_[n_in + 1]};
    for (size_t i = 3; i < n_in; ++i) in.push_back(saved_[i]);
    std::vector<Tensor> grads = quilt::apply(std::make_shared<SdpaBackward>(cfg_), in);
    grads.resize(n_in);  // no gradient for document ids or positions
    return grads;
  }

 private:
  // The inputs as the kernels read them (contiguous), their arguments and the outputs (out, lse).
  struct Buffers {
    std::vector<Tensor> x;
    Tensor out, lse;
    kernels::cpu::AttentionArgs args;
  };
  Buffers buffers(const std::vector<Tensor>& in) const {
    Buffers b;
    b.x = contiguous_all(in);
    const Tensor &q = b.x[0], &k = b.x[1], &v = b.x[2];
    b.out = Tensor::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, {.dtype = q.dtype(), .device = q.device()});
    b.lse = Tensor::empty({q.size(0), q.size(1), q.size(2)}, {.dtype = stat_dtype(q.dtype()), .device = q.device()});
    b.args = kernel_args(q, k, v, cfg_, b.x.data() + 3);
    return b;
  }

  Config cfg_;
};

double default_scale(std::optional<double> scale, int64_t d) {
  return scale.value_or(d > 0 ? 1.0 / std::sqrt(double(d)) : 1.0);
}

// scaled_dot_product_attention without a mask tensor; the composite leaves out the lse unless asked.
AttentionOutput attend(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options,
                       bool want_lse) {
  const Dims n = check_qkv(q, k, v);
  const std::pair<Tensor, Tensor> docs = documents(options, n);
  const std::pair<Tensor, Tensor> pos = positions(options, n);
  (void)common_device("scaled_dot_product_attention", {q, k, v, docs.first, docs.second, pos.first, pos.second});
  const int64_t offset = options.causal_offset.value_or(n.s - n.t);
  const double sc = default_scale(options.scale, n.d);
  const bool fused = q.device().is_cpu() || kernels::cuda::attention_supported(q.dtype(), n.d, n.dv);
  if (options.composite || !fused)
    return composite(q, k, v, n, Tensor(), options.causal, offset, sc, docs, pos, want_lse);
  const Config cfg{options.causal, sc, offset, docs.first.defined(), pos.first.defined()};
  std::vector<Tensor> in{q, k, v};
  if (cfg.docs) in.insert(in.end(), {docs.first, docs.second});
  if (cfg.pos) in.insert(in.end(), {pos.first, pos.second});
  std::vector<Tensor> out = quilt::apply(std::make_shared<Sdpa>(cfg), in);
  return {out[0], out[1]};
}

}  // namespace

AttentionOutput scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options) {
  return attend(q, k, v, options, true);
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, bool causal,
                                    std::optional<double> scale) {
  if (!mask.defined()) return attend(q, k, v, {.causal = causal, .scale = scale}, false).out;
  const Dims n = check_qkv(q, k, v);
  QUILT_CHECK(mask.dtype() == DType::b8, "[scaled_dot_product_attention] mask must be bool (true = attend), got ",
              dtype_name(mask.dtype()));
  const Shape full{n.b, n.hq, n.t, n.s};
  QUILT_CHECK(ops::broadcasts_to(mask.shape(), full), "[scaled_dot_product_attention] mask of shape ", mask.shape(),
              " does not broadcast to (B, Hq, T, S) = ", full);
  (void)common_device("scaled_dot_product_attention", {q, k, v, mask});
  return composite(q, k, v, n, mask, causal, n.s - n.t, default_scale(scale, n.d), {}, {}, false).out;
}

}  // namespace quilt
