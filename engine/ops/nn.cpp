// Softmax family, cross entropy, norms (and residual add + RMS norm), embedding, swiglu, rotary
// embedding and dropout. The fused ones are primitives whose backward calls a fused backward
// primitive (SoftmaxBackward, ...), so every gradient is still an op. Kernels:
// kernels/cpu/nn.h; CUDA (kernels/cuda/kernels.h, nn.h) for softmax, cross entropy, rms_norm,
// layer_norm and embedding. swiglu, add_rms_norm and
// rotary_embedding fall back to their composite forms for distributed or device tensors.
// scaled_dot_product_attention lives in attention.cpp.
#include "engine/ops/nn.h"

#include <cmath>

#include "engine/autograd.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/reduce.h"
#include "engine/ops/unary.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/nn.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/nn.h"

namespace quilt {
namespace {

using kernels::cpu::stat_dtype;

// ---- shared helpers ----

// x with `dim` moved last and rows made contiguous (copies only when needed). The kernels
// work on contiguous rows; a reduction over another dim pays one transpose copy.
Tensor rows_last(const Tensor& x, int64_t dim) {
  Tensor t = x.dim() == 0 || dim == x.dim() - 1 ? x : transpose(x, dim, -1);
  return contiguous(t);
}
// Undoes rows_last's transpose (a view).
Tensor from_rows_last(const Tensor& y, int64_t dim) {
  return y.dim() == 0 || dim == y.dim() - 1 ? y : transpose(y, dim, -1);
}
int64_t row_len(const Tensor& t) { return t.dim() == 0 ? 1 : t.size(-1); }
Shape lead_shape(const Tensor& t) { return Shape(t.shape().begin(), t.shape().end() - 1); }

// x's rows along a dim as the softmax kernels take them (rows_last), with an output like them.
struct Rows {
  Tensor x, out;
  int64_t rows, cols;
};
Rows rows_of(const Tensor& x, int64_t dim) {
  Rows r;
  r.x = rows_last(x.detach(), dim);
  r.out = Tensor::empty(r.x.shape(), {.dtype = r.x.dtype(), .device = r.x.device()});
  r.cols = row_len(r.x);
  r.rows = r.cols ? r.x.numel() / r.cols : 0;
  return r;
}

void* stream_of(const Tensor& t) { return ops::stream_handle(t.device()); }

bool is_index_dtype(DType d) { return d == DType::i32 || d == DType::i64; }

// The fused CPU primitives take local (non-distributed) CPU tensors; distributed or device
// tensors go through the composite forms, whose ops carry sharding rules and device kernels.
bool fused_cpu(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && (t->is_distributed() || !t->device().is_cpu())) return false;
  return true;
}

// Calls f(p, n) with the values of an integer tensor on the host (a copy for CUDA tensors).
template <class F>
void scan_indices(const Tensor& idx, F&& f) {
  Tensor t = contiguous(idx.device().is_cpu() ? idx : idx.to(Device::cpu()));
  if (t.dtype() == DType::i32) f(t.data<int32_t>(), t.numel());
  else f(t.data<int64_t>(), t.numel());
}

// ---- softmax / log_softmax ----

Tensor softmax_backward_op(const Tensor& g, const Tensor& y, int64_t dim, bool log);

class Softmax final : public Primitive {
 public:
  Softmax(int64_t dim, bool log) : dim_(dim), log_(log) {}
  const char* name() const override { return log_ ? "log_softmax" : "softmax"; }
  Attrs attrs() const override { return {{"dim", dim_}, {"log", log_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Rows r = rows_of(in[0], dim_);
    if (r.rows > 0) kernels::cpu::softmax_forward(r.x.dtype(), r.out.data_ptr(), r.x.data_ptr(), r.rows, r.cols, log_);
    return {from_rows_last(r.out, dim_)};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Rows r = rows_of(in[0], dim_);
    if (r.rows > 0)
      kernels::cuda::softmax_forward(r.x.dtype(), r.out.data_ptr(), r.x.data_ptr(), r.rows, r.cols, log_,
                                     stream_of(r.x));
    return {from_rows_last(r.out, dim_)};
  }
  void save(const std::vector<Tensor>&, const std::vector<Tensor>& out) override { saved_ = {out[0].detach()}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    return {softmax_backward_op(ctx.grads[0], saved_[0], dim_, log_)};
  }

 private:
  int64_t dim_;
  bool log_;
};

// (g, y) -> gradient of (log-)softmax at output y.
class SoftmaxBackward final : public Primitive {
 public:
  SoftmaxBackward(int64_t dim, bool log) : dim_(dim), log_(log) {}
  const char* name() const override { return log_ ? "log_softmax_backward" : "softmax_backward"; }
  Attrs attrs() const override { return {{"dim", dim_}, {"log", log_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor g = rows_last(in[0].detach(), dim_);
    const Rows y = rows_of(in[1], dim_);  // y.out: the gradient
    if (y.rows > 0)
      kernels::cpu::softmax_backward(y.x.dtype(), y.out.data_ptr(), g.data_ptr(), y.x.data_ptr(), y.rows, y.cols,
                                     log_);
    return {from_rows_last(y.out, dim_)};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor g = rows_last(in[0].detach(), dim_);
    const Rows y = rows_of(in[1], dim_);
    if (y.rows > 0)
      kernels::cuda::softmax_backward(y.x.dtype(), y.out.data_ptr(), g.data_ptr(), y.x.data_ptr(), y.rows, y.cols,
                                      log_, stream_of(y.x));
    return {from_rows_last(y.out, dim_)};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[1].detach()}; }
  // Linear in g, so its gradient w.r.t. g is the same map's adjoint. y is always a saved
  // (detached) output, so no gradient w.r.t. y is ever asked for.
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& h = ctx.grads[0];
    const Tensor& y = saved_[0];
    if (log_) return {h - sum(h * exp(y), {dim_}, true), Tensor()};
    return {softmax_backward_op(h, y, dim_, false), Tensor()};
  }

 private:
  int64_t dim_;
  bool log_;
};

Tensor softmax_backward_op(const Tensor& g, const Tensor& y, int64_t dim, bool log) {
  const Tensor gg = g.dtype() == y.dtype() ? g : cast(g, y.dtype());
  return apply1(std::make_shared<SoftmaxBackward>(dim, log), {gg, y});
}

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  QUILT_CHECK(x.defined(), "[", op, "] got an undefined tensor");
  QUILT_CHECK(is_floating(x.dtype()), "[", op, "] needs a floating tensor, got ", dtype_name(x.dtype()));
  return apply1(std::make_shared<Softmax>(wrap_dim(dim, x.dim(), op), log), {x});
}

// ---- cross entropy ----

void check_targets(const Tensor& target, int64_t classes, int64_t ignore) {
  scan_indices(target, [&](const auto* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = int64_t(p[i]);
      if (t != ignore && (t < 0 || t >= classes))
        fail("[cross_entropy] target ", t, " at row ", i, " is out of range for ", classes,
             " classes (valid: 0 to ", classes - 1, ", or ignore_index ", ignore, ")");
    }
  });
}

Tensor cross_entropy_backward_op(const Tensor& g, const Tensor& logits, const Tensor& target, int64_t ignore,
                                 const Tensor& lse = {});

// (logits (N, C), target (N)) -> per-row loss (N) in f32 (f64 for f64 logits on the CPU). On the
// CPU the forward also keeps each row's logsumexp (N floats), so that the backward forms
// softmax - onehot in one pass over the logits; it is kept aside rather than returned (the
// op's outputs, and so its sharding rules, stay as they are) and only for local logits.
class CrossEntropy final : public Primitive {
 public:
  explicit CrossEntropy(int64_t ignore) : ignore_(ignore) {}
  const char* name() const override { return "cross_entropy"; }
  Attrs attrs() const override { return {{"ignore_index", ignore_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor x = contiguous(in[0].detach());
    const Tensor t = contiguous(in[1].detach());
    const int64_t n = x.size(0), c = x.size(1);
    check_targets(t, c, ignore_);
    Tensor loss = Tensor::empty({n}, {.dtype = stat_dtype(x.dtype())});
    lse_ = Tensor::empty({n}, {.dtype = stat_dtype(x.dtype())});
    kernels::cpu::cross_entropy_forward(x.dtype(), loss.data_ptr(), x.data_ptr(), t.dtype(), t.data_ptr(), n, c,
                                        ignore_, lse_.data_ptr());
    return {loss};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor x = contiguous(in[0].detach());
    const Tensor t = contiguous(in[1].detach());
    const int64_t n = x.size(0), c = x.size(1);
    // The kernel checks the targets and reports a bad one on the device (the next
    // synchronisation throws naming it), so the op does not sync. With no classes at all there
    // is no kernel: every target must be ignored, checked here.
    if (c == 0) check_targets(t, c, ignore_);
    Tensor loss = Tensor::empty({n}, {.dtype = DType::f32, .device = x.device()});
    const Tensor t64 = contiguous(cast(t, DType::i64));
    if (n > 0 && c == 0) loss.zero_();  // every target was checked to be ignored
    else if (n > 0)
      kernels::cuda::cross_entropy_forward(x.dtype(), loss.data<float>(), x.data_ptr(), t64.data<int64_t>(), n, c,
                                           ignore_, stream_of(x));
    return {loss};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    // Under a distributed dispatcher forward() saw local pieces (perhaps a vocabulary shard):
    // their logsumexp is not the whole rows', so the backward recomputes it.
    const bool local = !in[0].is_distributed() && !in[1].is_distributed();
    saved_ = {in[0].detach(), in[1].detach(), local ? lse_ : Tensor()};
    lse_ = Tensor();
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    return {cross_entropy_backward_op(ctx.grads[0], saved_[0], saved_[1], ignore_, saved_[2]), Tensor()};
  }

 private:
  int64_t ignore_;
  Tensor lse_;  // (N) from the last CPU forward, until save()
};

// (g (N), logits (N, C), target (N)) -> g[r] * (softmax(logits[r]) - onehot(target[r])). `lse`
// (N), the forward's row logsumexp, when known: used only when the logits arrive whole.
class CrossEntropyBackward final : public Primitive {
 public:
  CrossEntropyBackward(int64_t ignore, Tensor lse) : ignore_(ignore), lse_(std::move(lse)) {}
  const char* name() const override { return "cross_entropy_backward"; }
  Attrs attrs() const override { return {{"ignore_index", ignore_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor x = contiguous(in[1].detach());
    const Tensor t = contiguous(in[2].detach());
    const int64_t n = x.size(0), c = x.size(1);
    Tensor gx = Tensor::empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
    const Tensor g = contiguous(cast(in[0].detach(), stat_dtype(x.dtype())));
    const bool use_lse = lse_.defined() && lse_.numel() == n && lse_.dtype() == stat_dtype(x.dtype()) &&
                         lse_.device().is_cpu();
    kernels::cpu::cross_entropy_backward(x.dtype(), gx.data_ptr(), x.data_ptr(), t.dtype(), t.data_ptr(),
                                         g.data_ptr(), n, c, ignore_, use_lse ? lse_.data_ptr() : nullptr);
    return {gx};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor x = contiguous(in[1].detach());
    const Tensor t = contiguous(in[2].detach());
    const int64_t n = x.size(0), c = x.size(1);
    Tensor gx = Tensor::empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
    if (n > 0 && c > 0) {
      const Tensor g = contiguous(cast(in[0].detach(), DType::f32));
      const Tensor t64 = contiguous(cast(t, DType::i64));
      kernels::cuda::cross_entropy_backward(x.dtype(), gx.data_ptr(), x.data_ptr(), t64.data<int64_t>(),
                                            g.data<float>(), n, c, ignore_, stream_of(x));
    }
    return {gx};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    saved_ = {in[1].detach(), in[2].detach()};
  }
  // Linear in g: d/dg[r] = sum_c h[r, c] * (softmax(x[r])[c] - onehot[r, c]), 0 where ignored.
  // The logits are always a saved (detached) tensor, so no gradient w.r.t. them is asked for.
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& h = ctx.grads[0];
    const Tensor& x = saved_[0];
    const Tensor& t = saved_[1];
    const Tensor classes = arange(0, double(x.size(1)), 1, {.dtype = t.dtype(), .device = x.device()});
    const Tensor onehot = cast(eq(classes, unsqueeze(t, 1)), h.dtype());
    const Tensor counted = cast(ne(t, scalar_like(double(ignore_), t)), h.dtype());
    return {sum(h * (softmax(x, -1) - onehot), {1}) * counted, Tensor(), Tensor()};
  }

 private:
  int64_t ignore_;
  Tensor lse_;
};

Tensor cross_entropy_backward_op(const Tensor& g, const Tensor& logits, const Tensor& target, int64_t ignore,
                                 const Tensor& lse) {
  const bool local = !g.is_distributed() && !logits.is_distributed() && !target.is_distributed();
  return apply1(std::make_shared<CrossEntropyBackward>(ignore, local ? lse : Tensor()), {g, logits, target});
}

// ---- RMS norm ----

class RmsNormBackward;

// (x, [weight]) -> (y, rstd); rstd (rows) is kept for backward and carries no gradient.
class RmsNorm final : public Primitive {
 public:
  RmsNorm(double eps, bool has_weight) : eps_(eps), has_w_(has_weight) {}
  const char* name() const override { return "rms_norm"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    kernels::cpu::rms_norm_forward(b.x.dtype(), b.y.data_ptr(), b.rstd.data_ptr(), b.x.data_ptr(),
                                   has_w_ ? b.w.data_ptr() : nullptr, b.rows, b.cols, eps_);
    return {b.y, b.rstd};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    kernels::cuda::rms_norm_forward(b.x.dtype(), b.y.data_ptr(), b.rstd.data_ptr(), b.x.data_ptr(),
                                    has_w_ ? b.w.data_ptr() : nullptr, b.rows, b.cols, eps_, stream_of(b.x));
    return {b.y, b.rstd};
  }
  bool differentiable_output(size_t i, const Tensor&) const override { return i == 0; }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>& out) override {
    saved_ = {in[0].detach(), has_w_ ? in[1].detach() : Tensor(), out[1].detach()};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override;

 private:
  // The inputs as the kernels read them (contiguous) and the outputs (y, rstd).
  struct Buffers {
    Tensor x, w, y, rstd;
    int64_t rows, cols;
  };
  Buffers buffers(const std::vector<Tensor>& in) const {
    Buffers b;
    b.x = contiguous(in[0].detach());
    b.w = has_w_ ? contiguous(in[1].detach()) : Tensor();
    b.cols = b.x.size(-1);
    b.rows = numel_of(lead_shape(b.x));
    b.y = Tensor::empty(b.x.shape(), {.dtype = b.x.dtype(), .device = b.x.device()});
    b.rstd = Tensor::empty(lead_shape(b.x), {.dtype = stat_dtype(b.x.dtype()), .device = b.x.device()});
    return b;
  }

  double eps_;
  bool has_w_;
};

// (g, x, [weight], rstd) -> (grad_x, [grad_weight]). Not differentiable itself.
class RmsNormBackward final : public Primitive {
 public:
  RmsNormBackward(bool has_weight, bool want_gw) : has_w_(has_weight), want_gw_(want_gw) {}
  const char* name() const override { return "rms_norm_backward"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    kernels::cpu::rms_norm_backward(b.x.dtype(), b.gx.data_ptr(), want_gw_ ? b.gw.data_ptr() : nullptr, b.g.data_ptr(),
                                    b.x.data_ptr(), has_w_ ? b.w.data_ptr() : nullptr, b.rstd.data_ptr(), b.rows,
                                    b.cols);
    return outputs(b);
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    kernels::cuda::rms_norm_backward(b.x.dtype(), b.gx.data_ptr(), want_gw_ ? b.gw.data_ptr() : nullptr,
                                     b.g.data_ptr(), b.x.data_ptr(), has_w_ ? b.w.data_ptr() : nullptr,
                                     b.rstd.data_ptr(), b.rows, b.cols, stream_of(b.x));
    return outputs(b);
  }

 private:
  // The inputs as the kernels read them (contiguous) and the gradients they write.
  struct Buffers {
    Tensor g, x, w, rstd, gx, gw;
    int64_t rows, cols;
  };
  Buffers buffers(const std::vector<Tensor>& in) const {
    Buffers b;
    b.g = contiguous(in[0].detach());
    b.x = contiguous(in[1].detach());
    b.w = has_w_ ? contiguous(in[2].detach()) : Tensor();
    b.rstd = contiguous(in[has_w_ ? 3 : 2].detach());
    b.cols = b.x.size(-1);
    b.rows = numel_of(lead_shape(b.x));
    b.gx = Tensor::empty(b.x.shape(), {.dtype = b.x.dtype(), .device = b.x.device()});
    b.gw = want_gw_ ? Tensor::empty({b.cols}, {.dtype = b.x.dtype(), .device = b.x.device()}) : Tensor();
    return b;
  }
  std::vector<Tensor> outputs(const Buffers& b) const {
    if (want_gw_) return {b.gx, b.gw};
    return {b.gx};
  }

  bool has_w_, want_gw_;
};

std::vector<Tensor> RmsNorm::backward(const BackwardContext& ctx) {
  const Tensor& x = saved_[0];
  const Tensor g = ctx.grads[0].dtype() == x.dtype() ? ctx.grads[0] : cast(ctx.grads[0], x.dtype());
  const bool want_gw = has_w_ && ctx.needs[1];
  std::vector<Tensor> in{g, x};
  if (has_w_) in.push_back(saved_[1]);
  in.push_back(saved_[2]);
  std::vector<Tensor> out = quilt::apply(std::make_shared<RmsNormBackward>(has_w_, want_gw), in);
  if (!has_w_) return {out[0]};
  return {out[0], want_gw ? out[1] : Tensor()};
}

// ---- residual add + RMS norm ----

class AddRmsNormBackward;

// (x, r, [weight]) -> (h = x + r, y = rms_norm(h), rstd); h and y carry gradients.
class AddRmsNorm final : public Primitive {
 public:
  AddRmsNorm(double eps, bool has_w) : eps_(eps), has_w_(has_w) {}
  const char* name() const override { return "add_rms_norm"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor x = contiguous(in[0].detach());
    const Tensor r = contiguous(in[1].detach());
    const Tensor w = has_w_ ? contiguous(in[2].detach()) : Tensor();
    const int64_t cols = x.size(-1), rows = numel_of(lead_shape(x));
    Tensor h = Tensor::empty(x.shape(), {.dtype = x.dtype()});
    Tensor y = Tensor::empty(x.shape(), {.dtype = x.dtype()});
    Tensor rstd = Tensor::empty(lead_shape(x), {.dtype = stat_dtype(x.dtype())});
    kernels::cpu::add_rms_norm_forward(x.dtype(), h.data_ptr(), y.data_ptr(), rstd.data_ptr(), x.data_ptr(),
                                       r.data_ptr(), has_w_ ? w.data_ptr() : nullptr, rows, cols, eps_);
    return {h, y, rstd};
  }
  bool differentiable_output(size_t i, const Tensor&) const override { return i < 2; }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>& out) override {
    saved_ = {out[0].detach(), has_w_ ? in[2].detach() : Tensor(), out[2].detach()};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override;

 private:
  double eps_;
  bool has_w_;
};

// (g_y, [g_h], h, [weight], rstd) -> (grad_h, [grad_weight]): the norm's backward with the
// gradient that reaches h directly added in the same pass. Not differentiable itself.
class AddRmsNormBackward final : public Primitive {
 public:
  AddRmsNormBackward(bool has_gh, bool has_w, bool want_gw) : has_gh_(has_gh), has_w_(has_w), want_gw_(want_gw) {}
  const char* name() const override { return "add_rms_norm_backward"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    size_t k = 0;
    const Tensor g = contiguous(in[k++].detach());
    const Tensor gh = has_gh_ ? contiguous(in[k++].detach()) : Tensor();
    const Tensor h = contiguous(in[k++].detach());
    const Tensor w = has_w_ ? contiguous(in[k++].detach()) : Tensor();
    const Tensor rstd = contiguous(in[k].detach());
    const int64_t cols = h.size(-1), rows = numel_of(lead_shape(h));
    Tensor gx = Tensor::empty(h.shape(), {.dtype = h.dtype()});
    Tensor gw = want_gw_ ? Tensor::empty({cols}, {.dtype = h.dtype()}) : Tensor();
    kernels::cpu::add_rms_norm_backward(h.dtype(), gx.data_ptr(), want_gw_ ? gw.data_ptr() : nullptr, g.data_ptr(),
                                        has_gh_ ? gh.data_ptr() : nullptr, h.data_ptr(),
                                        has_w_ ? w.data_ptr() : nullptr, rstd.data_ptr(), rows, cols);
    if (want_gw_) return {gx, gw};
    return {gx};
  }

 private:
  bool has_gh_, has_w_, want_gw_;
};

std::vector<Tensor> AddRmsNorm::backward(const BackwardContext& ctx) {
  const Tensor& h = saved_[0];
  auto as_h = [&](const Tensor& g) { return !g.defined() || g.dtype() == h.dtype() ? g : cast(g, h.dtype()); };
  const Tensor gh = as_h(ctx.grads[0]);
  const Tensor gy = as_h(ctx.grads[1]);
  const bool want_gw = has_w_ && ctx.needs[2];
  Tensor grad_h, grad_w;
  if (!gy.defined()) {  // only h was used: the norm contributes nothing
    grad_h = gh;
    if (want_gw) grad_w = zeros({h.size(-1)}, {.dtype = h.dtype()});
  } else {
    std::vector<Tensor> in{gy};
    if (gh.defined()) in.push_back(gh);
    in.push_back(h);
    if (has_w_) in.push_back(saved_[1]);
    in.push_back(saved_[2]);
    std::vector<Tensor> out =
        quilt::apply(std::make_shared<AddRmsNormBackward>(gh.defined(), has_w_, want_gw), in);
    grad_h = out[0];
    if (want_gw) grad_w = out[1];
  }
  if (!has_w_) return {grad_h, grad_h};
  return {grad_h, grad_h, grad_w};
}

// ---- swiglu ----

// (g, u) -> (g, u) gradients of silu(gate) * up. Not differentiable itself.
class SwigluBackward final : public Primitive {
 public:
  const char* name() const override { return "swiglu_backward"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor g = contiguous(in[0].detach());
    const Tensor gate = contiguous(in[1].detach());
    const Tensor up = contiguous(in[2].detach());
    Tensor dg = Tensor::empty(gate.shape(), {.dtype = gate.dtype()});
    Tensor du = Tensor::empty(gate.shape(), {.dtype = gate.dtype()});
    kernels::cpu::swiglu_backward(gate.dtype(), dg.data_ptr(), du.data_ptr(), g.data_ptr(), gate.data_ptr(),
                                  up.data_ptr(), gate.numel());
    return {dg, du};
  }
};

// (gate, up) of one shape and dtype -> silu(gate) * up in one pass.
class Swiglu final : public Primitive {
 public:
  const char* name() const override { return "swiglu"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor gate = contiguous(in[0].detach());
    const Tensor up = contiguous(in[1].detach());
    Tensor out = Tensor::empty(gate.shape(), {.dtype = gate.dtype()});
    kernels::cpu::swiglu_forward(gate.dtype(), out.data_ptr(), gate.data_ptr(), up.data_ptr(), gate.numel());
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    saved_ = {in[0].detach(), in[1].detach()};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& gate = saved_[0];
    const Tensor g = ctx.grads[0].dtype() == gate.dtype() ? ctx.grads[0] : cast(ctx.grads[0], gate.dtype());
    return quilt::apply(std::make_shared<SwigluBackward>(), {g, gate, saved_[1]});
  }
};

// ---- rotary embedding ----

// x (..., D) -> x rotated by the tables (held here in the compute dtype with their broadcast
// strides; see kernels::cpu::RopeLayout). Linear in x: the backward is the inverse rotation.
class Rope final : public Primitive {
 public:
  Rope(Tensor cos, Tensor sin, bool inverse) : cos_(std::move(cos)), sin_(std::move(sin)), inverse_(inverse) {}
  const char* name() const override { return inverse_ ? "rotary_embedding_backward" : "rotary_embedding"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    Tensor x = in[0].detach();
    if (x.dim() > 0 && x.stride(-1) != 1) x = contiguous(x);
    const int64_t nd = x.dim(), lead = nd - 1;
    kernels::cpu::RopeLayout l;
    l.ndim = int(lead);
    l.d = x.size(-1);
    const int64_t tdim = cos_.dim();
    const Shape tstr = contiguous_strides(cos_.shape());
    for (int64_t j = 0; j < lead; ++j) {
      const int64_t jt = j - (nd - tdim);  // the table's dim aligned with x's dim j
      l.lead[j] = x.size(j);
      l.x_strides[j] = x.stride(j);
      l.table_strides[j] = jt < 0 || cos_.size(jt) == 1 ? 0 : tstr[size_t(jt)];
    }
    Tensor out = Tensor::empty(x.shape(), {.dtype = x.dtype()});
    if (x.numel() > 0)
      kernels::cpu::rope_forward(x.dtype(), out.data_ptr(), x.data_ptr(), cos_.data_ptr(), sin_.data_ptr(), l,
                                 inverse_);
    return {out};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor g = ctx.grads[0].dtype() == ctx.inputs[0].dtype ? ctx.grads[0] : cast(ctx.grads[0], ctx.inputs[0].dtype);
    return {apply1(std::make_shared<Rope>(cos_, sin_, !inverse_), {g})};
  }

 private:
  Tensor cos_, sin_;  // contiguous, stat_dtype(x)
  bool inverse_;
};

// ---- layer norm ----

// (x, [weight], [bias]) -> (y, mean, rstd); the statistics carry no gradient.
class LayerNorm final : public Primitive {
 public:
  LayerNorm(double eps, bool has_w, bool has_b) : eps_(eps), has_w_(has_w), has_b_(has_b) {}
  const char* name() const override { return "layer_norm"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Buffers t = buffers(in);
    kernels::cpu::layer_norm_forward(t.x.dtype(), t.y.data_ptr(), t.mean.data_ptr(), t.rstd.data_ptr(), t.x.data_ptr(),
                                     has_w_ ? t.w.data_ptr() : nullptr, has_b_ ? t.b.data_ptr() : nullptr, t.rows,
                                     t.cols, eps_);
    return {t.y, t.mean, t.rstd};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Buffers t = buffers(in);
    kernels::cuda::layer_norm_forward(t.x.dtype(), t.y.data_ptr(), t.mean.data_ptr(), t.rstd.data_ptr(),
                                      t.x.data_ptr(), has_w_ ? t.w.data_ptr() : nullptr,
                                      has_b_ ? t.b.data_ptr() : nullptr, t.rows, t.cols, eps_, stream_of(t.x));
    return {t.y, t.mean, t.rstd};
  }
  bool differentiable_output(size_t i, const Tensor&) const override { return i == 0; }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>& out) override {
    saved_ = {in[0].detach(), has_w_ ? in[1].detach() : Tensor(), out[1].detach(), out[2].detach()};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override;

 private:
  // The inputs as the kernels read them (contiguous) and the outputs (y, mean, rstd).
  struct Buffers {
    Tensor x, w, b, y, mean, rstd;
    int64_t rows, cols;
  };
  Buffers buffers(const std::vector<Tensor>& in) const {
    Buffers t;
    t.x = contiguous(in[0].detach());
    t.w = has_w_ ? contiguous(in[1].detach()) : Tensor();
    t.b = has_b_ ? contiguous(in[has_w_ ? 2 : 1].detach()) : Tensor();
    t.cols = t.x.size(-1);
    t.rows = numel_of(lead_shape(t.x));
    const TensorOptions stat{.dtype = stat_dtype(t.x.dtype()), .device = t.x.device()};
    t.y = Tensor::empty(t.x.shape(), {.dtype = t.x.dtype(), .device = t.x.device()});
    t.mean = Tensor::empty(lead_shape(t.x), stat);
    t.rstd = Tensor::empty(lead_shape(t.x), stat);
    return t;
  }

  double eps_;
  bool has_w_, has_b_;
};

// (g, x, [weight], mean, rstd) -> (grad_x, [grad_weight], [grad_bias]). Not differentiable itself.
class LayerNormBackward final : public Primitive {
 public:
  LayerNormBackward(bool has_w, bool want_gw, bool want_gb) : has_w_(has_w), want_gw_(want_gw), want_gb_(want_gb) {}
  const char* name() const override { return "layer_norm_backward"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Buffers t = buffers(in);
    kernels::cpu::layer_norm_backward(t.x.dtype(), t.gx.data_ptr(), want_gw_ ? t.gw.data_ptr() : nullptr,
                                      want_gb_ ? t.gb.data_ptr() : nullptr, t.g.data_ptr(), t.x.data_ptr(),
                                      has_w_ ? t.w.data_ptr() : nullptr, t.mean.data_ptr(), t.rstd.data_ptr(), t.rows,
                                      t.cols);
    return {t.gx, t.gw, t.gb};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Buffers t = buffers(in);
    kernels::cuda::layer_norm_backward(t.x.dtype(), t.gx.data_ptr(), want_gw_ ? t.gw.data_ptr() : nullptr,
                                       want_gb_ ? t.gb.data_ptr() : nullptr, t.g.data_ptr(), t.x.data_ptr(),
                                       has_w_ ? t.w.data_ptr() : nullptr, t.mean.data_ptr(), t.rstd.data_ptr(), t.rows,
                                       t.cols, stream_of(t.x));
    return {t.gx, t.gw, t.gb};
  }

 private:
  // The inputs as the kernels read them (contiguous) and the gradients they write.
  struct Buffers {
    Tensor g, x, w, mean, rstd, gx, gw, gb;
    int64_t rows, cols;
  };
  Buffers buffers(const std::vector<Tensor>& in) const {
    Buffers t;
    t.g = contiguous(in[0].detach());
    t.x = contiguous(in[1].detach());
    const size_t k = has_w_ ? 3 : 2;
    t.w = has_w_ ? contiguous(in[2].detach()) : Tensor();
    t.mean = contiguous(in[k].detach());
    t.rstd = contiguous(in[k + 1].detach());
    t.cols = t.x.size(-1);
    t.rows = numel_of(lead_shape(t.x));
    const TensorOptions like_x{.dtype = t.x.dtype(), .device = t.x.device()};
    t.gx = Tensor::empty(t.x.shape(), like_x);
    t.gw = want_gw_ ? Tensor::empty({t.cols}, like_x) : Tensor();
    t.gb = want_gb_ ? Tensor::empty({t.cols}, like_x) : Tensor();
    return t;
  }

  bool has_w_, want_gw_, want_gb_;
};

std::vector<Tensor> LayerNorm::backward(const BackwardContext& ctx) {
  const Tensor& x = saved_[0];
  const Tensor g = ctx.grads[0].dtype() == x.dtype() ? ctx.grads[0] : cast(ctx.grads[0], x.dtype());
  const bool want_gw = has_w_ && ctx.needs[1];
  const bool want_gb = has_b_ && ctx.needs[has_w_ ? 2 : 1];
  std::vector<Tensor> in{g, x};
  if (has_w_) in.push_back(saved_[1]);
  in.push_back(saved_[2]);
  in.push_back(saved_[3]);
  std::vector<Tensor> out = quilt::apply(std::make_shared<LayerNormBackward>(has_w_, want_gw, want_gb), in);
  std::vector<Tensor> grads{out[0]};
  if (has_w_) grads.push_back(out[1]);
  if (has_b_) grads.push_back(out[2]);
  return grads;
}

// Shared argument checks of the norms; returns weight/bias cast to x's dtype.
Tensor norm_param(const char* op, const char* what, const Tensor& p, const Tensor& x) {
  if (!p.defined()) return p;
  QUILT_CHECK(is_floating(p.dtype()), "[", op, "] ", what, " must be floating, got ", dtype_name(p.dtype()));
  QUILT_CHECK(p.dim() == 1 && p.size(0) == x.size(-1), "[", op, "] ", what, " of shape ", p.shape(),
              " does not match the last dim of x ", x.shape());
  return p.dtype() == x.dtype() ? p : cast(p, x.dtype());
}

void check_norm_input(const char* op, const Tensor& x, double eps) {
  QUILT_CHECK(x.defined(), "[", op, "] got an undefined tensor");
  QUILT_CHECK(is_floating(x.dtype()), "[", op, "] needs a floating tensor, got ", dtype_name(x.dtype()));
  QUILT_CHECK(x.dim() >= 1, "[", op, "] needs at least 1 dim to normalise over, got a 0-d tensor");
  QUILT_CHECK(eps >= 0, "[", op, "] eps must be non-negative, got ", eps);
}

// ---- embedding ----

Tensor embedding_backward_op(const Tensor& g, const Tensor& indices, int64_t vocab);

// (weight (V, D), indices (*)) -> (*, D).
class Embedding final : public Primitive {
 public:
  const char* name() const override { return "embedding"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    const int64_t vocab = b.w.size(0);
    scan_indices(b.idx, [&](const auto* p, int64_t n) {
      for (int64_t i = 0; i < n; ++i)
        if (p[i] < 0 || int64_t(p[i]) >= vocab)
          fail("[embedding] index ", int64_t(p[i]), " at position ", i, " is out of range for a vocabulary of ",
               vocab, " rows (weight ", b.w.shape(), ")");
    });
    kernels::cpu::embedding_forward(b.w.dtype(), b.out.data_ptr(), b.w.data_ptr(), b.idx.dtype(), b.idx.data_ptr(),
                                    b.idx.numel(), b.w.size(1));
    return {b.out};
  }
  // The kernel checks the indices, not the host (which would copy them back and sync every
  // forward): an out-of-range index yields a zero row (and no gradient) and is reported on the
  // device, so the next synchronisation throws naming it.
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    kernels::cuda::embedding_forward(b.w.dtype(), b.out.data_ptr(), b.w.data_ptr(), b.idx.dtype(), b.idx.data_ptr(),
                                     b.idx.numel(), b.w.size(0), b.w.size(1), stream_of(b.w));
    return {b.out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[1].detach()}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    return {embedding_backward_op(ctx.grads[0], saved_[0], ctx.inputs[0].shape[0]), Tensor()};
  }

 private:
  // The weight and indices as the kernels read them (contiguous) and the output (*, D).
  struct Buffers {
    Tensor w, idx, out;
  };
  static Buffers buffers(const std::vector<Tensor>& in) {
    Buffers b;
    b.w = contiguous(in[0].detach());
    b.idx = contiguous(in[1].detach());
    Shape os = b.idx.shape();
    os.push_back(b.w.size(1));
    b.out = Tensor::empty(os, {.dtype = b.w.dtype(), .device = b.w.device()});
    return b;
  }
};

// (g (*, D), indices (*)) -> (V, D): rows of g added at their indices.
class EmbeddingBackward final : public Primitive {
 public:
  explicit EmbeddingBackward(int64_t vocab) : vocab_(vocab) {}
  const char* name() const override { return "embedding_backward"; }
  Attrs attrs() const override { return {{"vocab", vocab_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    kernels::cpu::embedding_backward(b.g.dtype(), b.gw.data_ptr(), b.g.data_ptr(), b.idx.dtype(), b.idx.data_ptr(),
                                     b.idx.numel(), vocab_, b.g.size(-1));
    return {b.gw};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Buffers b = buffers(in);
    kernels::cuda::embedding_backward(b.g.dtype(), b.gw.data_ptr(), b.g.data_ptr(), b.idx.dtype(), b.idx.data_ptr(),
                                      b.idx.numel(), vocab_, b.g.size(-1), stream_of(b.g));
    return {b.gw};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[1].detach()}; }
  // Linear in g: its adjoint gathers the rows again.
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    return {embedding(ctx.grads[0], saved_[0]), Tensor()};
  }

 private:
  // g and the indices as the kernels read them (contiguous) and the weight's gradient (V, D).
  struct Buffers {
    Tensor g, idx, gw;
  };
  Buffers buffers(const std::vector<Tensor>& in) const {
    Buffers b;
    b.g = contiguous(in[0].detach());
    b.idx = contiguous(in[1].detach());
    b.gw = Tensor::empty({vocab_, b.g.size(-1)}, {.dtype = b.g.dtype(), .device = b.g.device()});
    return b;
  }

  int64_t vocab_;
};

Tensor embedding_backward_op(const Tensor& g, const Tensor& indices, int64_t vocab) {
  return apply1(std::make_shared<EmbeddingBackward>(vocab), {g, indices});
}

// ---- dropout ----

// dropout() written with other ops: the CUDA path (there is no fused CUDA dropout kernel).
// Matches the CPU kernel bit for bit: same mask, same f32 (f64) scaling, one rounding.
Tensor dropout_composite(const Tensor& x, double p, RngKey key) {
  const Tensor keep = dropout_mask(x.shape(), p, key, x.device());
  const bool widen = x.dtype() == DType::bf16 || x.dtype() == DType::f16;
  const Tensor xs = widen ? cast(x, DType::f32) : x;
  const Tensor out = where(keep, xs * (1.0 / (1.0 - p)), zeros({}, {.dtype = xs.dtype(), .device = x.device()}));
  return widen ? cast(out, x.dtype()) : out;
}

class Dropout final : public Primitive {
 public:
  Dropout(double p, RngKey key) : p_(p), key_(key) {}
  const char* name() const override { return "dropout"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor x = contiguous(in[0].detach());  // the mask follows the row-major index
    Tensor out = Tensor::empty(x.shape(), {.dtype = x.dtype()});
    kernels::cpu::dropout(x.dtype(), out.data_ptr(), x.data_ptr(), x.numel(), p_, key_.seed, key_.key);
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    return {dropout_composite(contiguous(in[0].detach()), p_, key_)};
  }
  // Same key, same mask: the gradient is dropout of the incoming gradient.
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    return {apply1(std::make_shared<Dropout>(p_, key_), {ctx.grads[0]})};
  }

 private:
  double p_;
  RngKey key_;
};

void check_p(double p) { QUILT_CHECK(p >= 0.0 && p <= 1.0, "[dropout] p must be in [0, 1], got ", p); }

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true); }

Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, Reduction reduction) {
  QUILT_CHECK(logits.defined() && target.defined(), "[cross_entropy] got an undefined tensor");
  QUILT_CHECK(is_floating(logits.dtype()), "[cross_entropy] logits must be floating, got ",
              dtype_name(logits.dtype()));
  QUILT_CHECK(is_index_dtype(target.dtype()), "[cross_entropy] target must hold class indices (i32 or i64), got ",
              dtype_name(target.dtype()));
  QUILT_CHECK(logits.dim() >= 1, "[cross_entropy] logits need a class dim, got shape ", logits.shape());
  const Shape lead = lead_shape(logits);
  QUILT_CHECK(target.shape() == lead, "[cross_entropy] target of shape ", target.shape(),
              " does not match logits of shape ", logits.shape(), " (expected target shape ", lead, ")");
  (void)common_device("cross_entropy", {logits, target});
  const int64_t n = numel_of(lead), c = logits.size(-1);
  const Tensor t = reshape(target, {n});
  const Tensor rows = apply1(std::make_shared<CrossEntropy>(ignore_index), {reshape(logits, {n, c}), t});
  Tensor out;
  switch (reduction) {
    case Reduction::none: out = reshape(rows, lead); break;
    case Reduction::sum: out = sum(rows); break;
    case Reduction::mean: {
      // 0 / 0 = NaN when nothing is counted, as in PyTorch.
      const Tensor counted = sum(cast(ne(t, scalar_like(double(ignore_index), t)), rows.dtype()));
      out = sum(rows) / counted;
      break;
    }
  }
  return cast(out, logits.dtype());
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  QUILT_CHECK(weight.defined() && indices.defined(), "[embedding] got an undefined tensor");
  QUILT_CHECK(is_floating(weight.dtype()), "[embedding] weight must be floating, got ", dtype_name(weight.dtype()));
  QUILT_CHECK(weight.dim() == 2, "[embedding] weight must be (V, D), got shape ", weight.shape());
  QUILT_CHECK(is_index_dtype(indices.dtype()), "[embedding] indices must be i32 or i64, got ",
              dtype_name(indices.dtype()));
  (void)common_device("embedding", {weight, indices});
  return apply1(std::make_shared<Embedding>(), {weight, indices});
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_norm_input("rms_norm", x, eps);
  const Tensor w = norm_param("rms_norm", "weight", weight, x);
  (void)common_device("rms_norm", {x, w});
  std::vector<Tensor> in{x};
  if (w.defined()) in.push_back(w);
  return quilt::apply(std::make_shared<RmsNorm>(eps, w.defined()), in)[0];
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  check_norm_input("layer_norm", x, eps);
  const Tensor w = norm_param("layer_norm", "weight", weight, x);
  const Tensor b = norm_param("layer_norm", "bias", bias, x);
  (void)common_device("layer_norm", {x, w, b});
  std::vector<Tensor> in{x};
  if (w.defined()) in.push_back(w);
  if (b.defined()) in.push_back(b);
  return quilt::apply(std::make_shared<LayerNorm>(eps, w.defined(), b.defined()), in)[0];
}

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  QUILT_CHECK(gate.defined() && up.defined(), "[swiglu] got an undefined tensor");
  QUILT_CHECK(is_floating(gate.dtype()) && is_floating(up.dtype()), "[swiglu] needs floating tensors, got ",
              dtype_name(gate.dtype()), " and ", dtype_name(up.dtype()));
  (void)broadcast_shapes(gate.shape(), up.shape(), "swiglu");
  if (gate.shape() == up.shape() && gate.dtype() == up.dtype() && fused_cpu({&gate, &up}))
    return apply1(std::make_shared<Swiglu>(), {gate, up});
  return silu(gate) * up;
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps) {
  check_norm_input("add_rms_norm", x, eps);
  QUILT_CHECK(residual.defined(), "[add_rms_norm] got an undefined residual");
  QUILT_CHECK(residual.shape() == x.shape() && residual.dtype() == x.dtype(), "[add_rms_norm] residual ",
              residual.shape(), " ", dtype_name(residual.dtype()), " does not match x ", x.shape(), " ",
              dtype_name(x.dtype()));
  const Tensor w = norm_param("add_rms_norm", "weight", weight, x);
  (void)common_device("add_rms_norm", {x, residual, w});
  if (!fused_cpu({&x, &residual, &w})) {
    const Tensor h = x + residual;
    return {h, rms_norm(h, w, eps)};
  }
  std::vector<Tensor> in{x, residual};
  if (w.defined()) in.push_back(w);
  std::vector<Tensor> out = quilt::apply(std::make_shared<AddRmsNorm>(eps, w.defined()), in);
  return {out[0], out[1]};
}

Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  QUILT_CHECK(x.defined() && cos.defined() && sin.defined(), "[rotary_embedding] got an undefined tensor");
  QUILT_CHECK(is_floating(x.dtype()) && is_floating(cos.dtype()) && is_floating(sin.dtype()),
              "[rotary_embedding] needs floating tensors, got x ", dtype_name(x.dtype()), ", cos ",
              dtype_name(cos.dtype()), ", sin ", dtype_name(sin.dtype()));
  QUILT_CHECK(x.dim() >= 2, "[rotary_embedding] x must be (..., T, D), got shape ", x.shape());
  const int64_t d = x.size(-1);
  QUILT_CHECK(d % 2 == 0, "[rotary_embedding] the last dim of x must be even, got shape ", x.shape());
  QUILT_CHECK(cos.shape() == sin.shape(), "[rotary_embedding] cos ", cos.shape(), " and sin ", sin.shape(),
              " differ in shape");
  Shape half = x.shape();
  half.back() = d / 2;
  QUILT_CHECK(cos.dim() >= 1 && ops::broadcasts_to(cos.shape(), half) && cos.size(-1) == d / 2,
              "[rotary_embedding] tables of shape ", cos.shape(), " do not broadcast to ", half, " (x of shape ",
              x.shape(), ")");
  (void)common_device("rotary_embedding", {x, cos, sin});
  if (fused_cpu({&x, &cos, &sin}) && !cos.requires_grad() && !sin.requires_grad()) {
    // Tables rounded to x's dtype (as the composite does), then held in the compute dtype.
    auto table = [&](const Tensor& t) {
      NoGradGuard ng;
      return contiguous(cast(cast(t, x.dtype()), stat_dtype(x.dtype())));
    };
    return apply1(std::make_shared<Rope>(table(cos), table(sin), false), {x});
  }
  // Composite (gradients for the tables, distributed or device tensors): x viewed as
  // (..., T, 2, D/2): row 0 holds x1 = x[..., :D/2], row 1 holds x2. Then
  // out = x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1) built by a where
  // over the size-2 dim, so no cat (and no copy of x beyond the arithmetic) is needed.
  const Tensor c = unsqueeze(cast(cos, x.dtype()), -2);  // (..., T, 1, D/2)
  const Tensor s = unsqueeze(cast(sin, x.dtype()), -2);
  Shape pairs(x.shape().begin(), x.shape().end() - 1);
  pairs.push_back(2);
  pairs.push_back(d / 2);
  const Tensor xs = reshape(x, pairs);
  const Tensor first = from_vector({1, 0}, {2, 1}, {.dtype = DType::b8, .device = x.device()});
  const Tensor rot = where(first, neg(narrow(xs, -2, 1, 1)), narrow(xs, -2, 0, 1));
  return reshape(xs * c + rot * s, x.shape());
}

Tensor dropout_mask(const Shape& shape, double p, RngKey key, Device device) {
  check_p(p);
  // Element i is kept iff f > p, f = (k + 1) / 2^24 being its 24-bit Philox uniform (as the CPU
  // kernel draws it). rand() in f32 yields exactly u = 1 - f, and f > p <=> f >= thr, thr the
  // next multiple of 2^-24 above p, so the test u <= 1 - thr is exact in f32.
  constexpr double k24 = 16777216.0;
  const double thr = (std::floor(p * k24) + 1.0) / k24;
  const Tensor u = rand(shape, key, {.dtype = DType::f32, .device = device});
  return le(u, scalar_tensor(1.0 - thr, {.dtype = DType::f32, .device = device}));
}

Tensor dropout(const Tensor& x, double p, RngKey key, bool train) {
  QUILT_CHECK(x.defined(), "[dropout] got an undefined tensor");
  check_p(p);
  QUILT_CHECK(is_floating(x.dtype()), "[dropout] needs a floating tensor, got ", dtype_name(x.dtype()));
  if (!train || p == 0.0) return x;
  return apply1(std::make_shared<Dropout>(p, key), {x});
}

Tensor dropout(const Tensor& x, double p, Generator& gen, bool train) {
  check_p(p);
  if (!train || p == 0.0) return dropout(x, p, RngKey{}, train);  // draws no key when nothing is dropped
  return dropout(x, p, gen.next(), train);
}

}  // namespace quilt
