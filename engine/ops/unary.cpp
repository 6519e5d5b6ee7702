// Elementwise unary ops: one primitive parameterised by the kernel op, backward per op.
#include "engine/ops/unary.h"

#include <limits>

#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cuda/kernels.h"

namespace quilt {
namespace {

using kernels::UnaryOp;

bool needs_floating(UnaryOp op) {
  return !(op == UnaryOp::neg || op == UnaryOp::abs || op == UnaryOp::sign || op == UnaryOp::square ||
           op == UnaryOp::relu || op == UnaryOp::logical_not);
}

bool saves_output(UnaryOp op) {
  return op == UnaryOp::exp || op == UnaryOp::sqrt || op == UnaryOp::rsqrt || op == UnaryOp::tanh ||
         op == UnaryOp::sigmoid;
}

class Unary final : public Primitive {
 public:
  explicit Unary(UnaryOp op) : op_(op) {}
  const char* name() const override { return kernels::op_name(op_); }

  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Tensor out = output_for(x);
    kernels::cpu::unary(op_, x.dtype(), ops::loop_over<2>(x.shape(), {&out, &x}));
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Tensor out = output_for(x);
    kernels::cuda::unary(op_, x.dtype(), ops::loop_over<2>(x.shape(), {&out, &x}), ops::stream_handle(x.device()));
    return {out};
  }

  void save(const std::vector<Tensor>& in, const std::vector<Tensor>& out) override {
    if (op_ == UnaryOp::neg || op_ == UnaryOp::sign) return;
    saved_ = {saves_output(op_) ? out[0].detach() : in[0].detach()};
  }

  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    switch (op_) {
      case UnaryOp::neg: return {neg(g)};
      case UnaryOp::exp: return {g * saved_[0]};
      case UnaryOp::log: return {g / saved_[0]};
      case UnaryOp::sqrt: return {g * 0.5 / saved_[0]};
      case UnaryOp::rsqrt: { const Tensor& y = saved_[0]; return {g * -0.5 * y * y * y}; }
      case UnaryOp::tanh: { const Tensor& y = saved_[0]; return {g * (1.0 - y * y)}; }
      case UnaryOp::sigmoid: { const Tensor& y = saved_[0]; return {g * y * (1.0 - y)}; }
      case UnaryOp::silu: {
        const Tensor& x = saved_[0];
        Tensor s = sigmoid(x);
        return {g * s * (1.0 + x * (1.0 - s))};
      }
      case UnaryOp::gelu: return {g * gelu_grad(saved_[0])};
      case UnaryOp::relu: return {g * cast(gt(saved_[0], scalar_like(0, saved_[0])), g.dtype())};
      case UnaryOp::abs: return {g * sign(saved_[0])};
      case UnaryOp::sign: return {zeros_like(g)};
      case UnaryOp::sin: return {g * cos(saved_[0])};
      case UnaryOp::cos: return {neg(g * sin(saved_[0]))};
      case UnaryOp::square: return {g * 2.0 * saved_[0]};
      default: fail("[", name(), "] is not differentiable");
    }
  }

 private:
  // Checks x's dtype for the op and allocates the output.
  Tensor output_for(const Tensor& x) const {
    QUILT_CHECK(!needs_floating(op_) || is_floating(x.dtype()), "[", name(), "] needs a floating tensor, got ",
                dtype_name(x.dtype()));
    QUILT_CHECK(op_ == UnaryOp::logical_not || x.dtype() != DType::b8, "[", name(), "] is not defined for bool tensors");
    const DType odt = op_ == UnaryOp::logical_not ? DType::b8 : x.dtype();
    return Tensor::empty(x.shape(), {.dtype = odt, .device = x.device()});
  }

  UnaryOp op_;
};

Tensor run(UnaryOp op, const Tensor& x) { return apply1(std::make_shared<Unary>(op), {x}); }

}  // namespace

Tensor neg(const Tensor& x) { return run(UnaryOp::neg, x); }
Tensor exp(const Tensor& x) { return run(UnaryOp::exp, x); }
Tensor log(const Tensor& x) { return run(UnaryOp::log, x); }
Tensor sqrt(const Tensor& x) { return run(UnaryOp::sqrt, x); }
Tensor rsqrt(const Tensor& x) { return run(UnaryOp::rsqrt, x); }
Tensor tanh(const Tensor& x) { return run(UnaryOp::tanh, x); }
Tensor sigmoid(const Tensor& x) { return run(UnaryOp::sigmoid, x); }
Tensor silu(const Tensor& x) { return run(UnaryOp::silu, x); }
Tensor gelu(const Tensor& x) { return run(UnaryOp::gelu, x); }
Tensor relu(const Tensor& x) { return run(UnaryOp::relu, x); }
Tensor abs(const Tensor& x) { return run(UnaryOp::abs, x); }
Tensor sign(const Tensor& x) { return run(UnaryOp::sign, x); }
Tensor sin(const Tensor& x) { return run(UnaryOp::sin, x); }
Tensor cos(const Tensor& x) { return run(UnaryOp::cos, x); }
Tensor square(const Tensor& x) { return run(UnaryOp::square, x); }
Tensor logical_not(const Tensor& x) { return run(UnaryOp::logical_not, x); }
Tensor isfinite(const Tensor& x) {
  // |x| < inf is false for NaN (every comparison with it is) and for ±inf.
  if (!is_floating(x.dtype())) return eq(x, x);
  return lt(abs(x), scalar_like(std::numeric_limits<double>::infinity(), x));
}
Tensor gelu_grad(const Tensor& x) { return run(UnaryOp::gelu_grad, x); }
Tensor operator-(const Tensor& x) { return neg(x); }

}  // namespace quilt
