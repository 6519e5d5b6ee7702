// Elementwise binary ops with broadcasting and promotion; where; sum_to.
#include "engine/ops/binary.h"

#include "engine/ops/creation.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/reduce.h"
#include "engine/ops/unary.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cuda/kernels.h"

namespace quilt {
namespace {

using kernels::BinaryOp;

int rank(DType t) {
  switch (t) {
    case DType::b8: return 0;
    case DType::i32: return 1;
    case DType::i64: return 2;
    case DType::f16: return 3;
    case DType::bf16: return 3;
    case DType::f32: return 4;
    case DType::f64: return 5;
  }
  return 0;
}

class Binary final : public Primitive {
 public:
  explicit Binary(BinaryOp op) : op_(op) {}
  const char* name() const override { return kernels::op_name(op_); }

  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    Tensor out = output_for(in[0], in[1]);
    kernels::cpu::binary(op_, in[0].dtype(), ops::loop_over<3>(out.shape(), {&out, &in[0], &in[1]}));
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    Tensor out = output_for(in[0], in[1]);
    kernels::cuda::binary(op_, in[0].dtype(), ops::loop_over<3>(out.shape(), {&out, &in[0], &in[1]}),
                          ops::stream_handle(out.device()));
    return {out};
  }

  void save(const std::vector<Tensor>& in, const std::vector<Tensor>& out) override {
    switch (op_) {
      case BinaryOp::add:
      case BinaryOp::sub: return;
      case BinaryOp::pow: saved_ = {in[0].detach(), in[1].detach(), out[0].detach()}; return;
      default: saved_ = {in[0].detach(), in[1].detach()};
    }
  }

  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    const Shape& sa = ctx.inputs[0].shape;
    const Shape& sb = ctx.inputs[1].shape;
    Tensor ga, gb;
    switch (op_) {
      case BinaryOp::add: ga = g; gb = g; break;
      case BinaryOp::sub: ga = g; if (ctx.needs[1]) gb = neg(g); break;
      case BinaryOp::mul:
        if (ctx.needs[0]) ga = g * saved_[1];
        if (ctx.needs[1]) gb = g * saved_[0];
        break;
      case BinaryOp::div:
        if (ctx.needs[0]) ga = g / saved_[1];
        if (ctx.needs[1]) gb = neg(g * saved_[0] / square(saved_[1]));
        break;
      case BinaryOp::pow: {
        const Tensor& a = saved_[0];
        const Tensor& b = saved_[1];
        if (ctx.needs[0]) ga = g * b * pow(a, b - 1.0);
        if (ctx.needs[1]) {
          // d/db a^b = a^b log a, taken as 0 where a <= 0 (as the limit for a -> 0+).
          Tensor pos = gt(a, scalar_like(0, a));
          gb = g * where(pos, saved_[2] * log(where(pos, a, ones_like(a))), zeros_like(saved_[2]));
        }
        break;
      }
      case BinaryOp::maximum:
      case BinaryOp::minimum: {
        const Tensor& a = saved_[0];
        const Tensor& b = saved_[1];
        Tensor win_a = cast(op_ == BinaryOp::maximum ? gt(a, b) : lt(a, b), g.dtype());
        Tensor tie = cast(eq(a, b), g.dtype()) * 0.5;  // ties split the gradient evenly
        if (ctx.needs[0]) ga = g * (win_a + tie);
        if (ctx.needs[1]) gb = g * (1.0 - win_a - tie);
        break;
      }
      default: fail("[", name(), "] is not differentiable");
    }
    return {ga.defined() && ctx.needs[0] ? sum_to(ga, sa) : Tensor(),
            gb.defined() && ctx.needs[1] ? sum_to(gb, sb) : Tensor()};
  }

 private:
  // The output at the broadcast shape of a and b (on their device, which forward() checked).
  Tensor output_for(const Tensor& a, const Tensor& b) const {
    const Shape shape = broadcast_shapes(a.shape(), b.shape(), name());
    const DType odt = kernels::is_predicate(op_) ? DType::b8 : a.dtype();
    return Tensor::empty(shape, {.dtype = odt, .device = a.device()});
  }

  BinaryOp op_;
};

class Where final : public Primitive {
 public:
  const char* name() const override { return "where"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    Tensor out = output_for(in);
    kernels::cpu::where(out.dtype(), ops::loop_over<4>(out.shape(), {&out, &in[0], &in[1], &in[2]}));
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    Tensor out = output_for(in);
    kernels::cuda::where(out.dtype(), ops::loop_over<4>(out.shape(), {&out, &in[0], &in[1], &in[2]}),
                         ops::stream_handle(out.device()));
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[0].detach()}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    Tensor z = zeros({}, {.dtype = g.dtype(), .device = g.device()});
    Tensor ga, gb;
    if (ctx.needs[1]) ga = sum_to(where(saved_[0], g, z), ctx.inputs[1].shape);
    if (ctx.needs[2]) gb = sum_to(where(saved_[0], z, g), ctx.inputs[2].shape);
    return {Tensor(), ga, gb};
  }

 private:
  // Checks the condition and allocates the output at the shape (c, a, b) broadcast to.
  static Tensor output_for(const std::vector<Tensor>& in) {
    const Tensor &c = in[0], &a = in[1], &b = in[2];
    QUILT_CHECK(c.dtype() == DType::b8, "[where] condition must be bool, got ", dtype_name(c.dtype()));
    const Shape shape = broadcast_shapes(broadcast_shapes(c.shape(), a.shape(), "where"), b.shape(), "where");
    return Tensor::empty(shape, {.dtype = a.dtype(), .device = a.device()});
  }
};

Tensor run(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* nm = kernels::op_name(op);
  QUILT_CHECK(a.defined() && b.defined(), "[", nm, "] got an undefined tensor");
  DType dt = promote_types(a.dtype(), b.dtype());
  if (op == BinaryOp::div && !is_floating(dt)) dt = DType::f32;
  if ((op == BinaryOp::pow) && !is_floating(dt)) dt = DType::f32;
  Tensor x = a.dtype() == dt ? a : cast(a, dt);
  Tensor y = b.dtype() == dt ? b : cast(b, dt);
  return apply1(std::make_shared<Binary>(op), {x, y});
}

}  // namespace

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if ((a == DType::bf16 && b == DType::f16) || (a == DType::f16 && b == DType::bf16)) return DType::f32;
  return rank(a) >= rank(b) ? a : b;
}

Tensor scalar_like(double v, const Tensor& like) {
  return scalar_tensor(v, {.dtype = like.dtype(), .device = like.device()});
}

Tensor sum_to(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const int64_t lead = grad.dim() - int64_t(shape.size());
  QUILT_CHECK(lead >= 0, "[sum_to] cannot reduce shape ", grad.shape(), " to ", shape);
  Shape dims;
  for (int64_t i = 0; i < grad.dim(); ++i) {
    if (i < lead) dims.push_back(i);
    else if (shape[size_t(i - lead)] == 1 && grad.shape()[size_t(i)] != 1) dims.push_back(i);
  }
  Tensor r = dims.empty() ? grad : sum(grad, dims, true);
  return reshape(r, shape);
}

Tensor add(const Tensor& a, const Tensor& b) { return run(BinaryOp::add, a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return run(BinaryOp::sub, a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return run(BinaryOp::mul, a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return run(BinaryOp::div, a, b); }
Tensor pow(const Tensor& a, const Tensor& b) { return run(BinaryOp::pow, a, b); }
Tensor pow(const Tensor& a, double e) { return run(BinaryOp::pow, a, scalar_like(e, a)); }
Tensor maximum(const Tensor& a, const Tensor& b) { return run(BinaryOp::maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return run(BinaryOp::minimum, a, b); }
Tensor eq(const Tensor& a, const Tensor& b) { return run(BinaryOp::eq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return run(BinaryOp::ne, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return run(BinaryOp::lt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return run(BinaryOp::le, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return run(BinaryOp::gt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return run(BinaryOp::ge, a, b); }
Tensor logical_and(const Tensor& a, const Tensor& b) { return run(BinaryOp::logical_and, a, b); }
Tensor logical_or(const Tensor& a, const Tensor& b) { return run(BinaryOp::logical_or, a, b); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  const DType dt = promote_types(a.dtype(), b.dtype());
  Tensor x = a.dtype() == dt ? a : cast(a, dt);
  Tensor y = b.dtype() == dt ? b : cast(b, dt);
  Tensor c = cond.dtype() == DType::b8 ? cond : cast(cond, DType::b8);
  return apply1(std::make_shared<Where>(), {c, x, y});
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  return where(mask, scalar_like(value, x), x);
}

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, double b) { return add(a, scalar_like(b, a)); }
Tensor operator-(const Tensor& a, double b) { return sub(a, scalar_like(b, a)); }
Tensor operator*(const Tensor& a, double b) { return mul(a, scalar_like(b, a)); }
Tensor operator/(const Tensor& a, double b) {
  return is_floating(a.dtype()) ? mul(a, scalar_like(1.0 / b, a)) : div(a, scalar_like(b, a));
}
Tensor operator+(double a, const Tensor& b) { return add(scalar_like(a, b), b); }
Tensor operator-(double a, const Tensor& b) { return sub(scalar_like(a, b), b); }
Tensor operator*(double a, const Tensor& b) { return mul(scalar_like(a, b), b); }
Tensor operator/(double a, const Tensor& b) { return div(scalar_like(a, b), b); }

}  // namespace quilt
