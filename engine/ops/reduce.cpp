// Reductions: sum, max, min (with even split of ties in backward), argmax, sum of squares.
#include "engine/ops/reduce.h"

#include <algorithm>

#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cuda/kernels.h"

namespace quilt {
namespace {

using kernels::ReduceOp;

// Sorted, de-duplicated, wrapped dims (all dims when empty).
Shape normalize_dims(const Shape& dims, int64_t ndim, const char* op) {
  Shape out;
  if (dims.empty()) {
    for (int64_t i = 0; i < ndim; ++i) out.push_back(i);
    return out;
  }
  for (int64_t d : dims) out.push_back(wrap_dim(d, ndim, op));
  std::sort(out.begin(), out.end());
  QUILT_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), "[", op, "] dim repeated in ", dims);
  if (ndim == 0) out.clear();
  return out;
}

Shape reduced_shape(const Shape& shape, const Shape& dims, bool keepdim) {
  Shape out;
  for (int64_t i = 0; i < int64_t(shape.size()); ++i) {
    const bool red = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!red) out.push_back(shape[size_t(i)]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

// The kernel's loop: `out` is contiguous with the kept dims of x (any keepdim form).
kernels::ReduceLoop reduce_loop(const Tensor& x, const Shape& dims, Tensor& out) {
  kernels::ReduceLoop l;
  const Shape ost = contiguous_strides(reduced_shape(x.shape(), dims, false));
  size_t k = 0;
  for (int64_t i = 0; i < x.dim(); ++i) {
    const bool red = std::find(dims.begin(), dims.end(), i) != dims.end();
    const int64_t s = x.shape()[size_t(i)], st = x.strides()[size_t(i)];
    if (red) {
      if (s == 1) continue;
      if (l.red_ndim > 0 && l.red_strides[l.red_ndim - 1] == st * s) {  // merge with the previous reduced dim
        l.red_shape[l.red_ndim - 1] *= s;
        l.red_strides[l.red_ndim - 1] = st;
      } else {
        l.red_shape[l.red_ndim] = s;
        l.red_strides[l.red_ndim] = st;
        ++l.red_ndim;
      }
    } else {
      l.out_shape[l.out_ndim] = s;
      l.out_strides[l.out_ndim] = ost[k++];
      l.in_out_strides[l.out_ndim] = st;
      ++l.out_ndim;
    }
  }
  // A reduced dim could be split from its run when non-reduced size-1 dims sat between.
  l.out = out.data_ptr();
  l.in = x.data_ptr();
  return l;
}

class Reduce final : public Primitive {
 public:
  Reduce(ReduceOp op, Shape dims, bool keepdim) : op_(op), dims_(std::move(dims)), keepdim_(keepdim) {}
  const char* name() const override {
    switch (op_) {
      case ReduceOp::sum: return "sum";
      case ReduceOp::max: return "max";
      case ReduceOp::min: return "min";
      case ReduceOp::argmax: return "argmax";
      case ReduceOp::sum_squares: return "sum_squares";
    }
    return "reduce";
  }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Tensor out = output_for(x);
    if (out.numel() > 0) kernels::cpu::reduce(op_, x.dtype(), out.dtype(), reduce_loop(x, dims_, out));
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Tensor out = output_for(x);
    if (out.numel() > 0)
      kernels::cuda::reduce(op_, x.dtype(), out.dtype(), reduce_loop(x, dims_, out), ops::stream_handle(x.device()));
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>& out) override {
    if (op_ == ReduceOp::max || op_ == ReduceOp::min) saved_ = {in[0].detach(), out[0].detach()};
    else if (op_ == ReduceOp::sum_squares) saved_ = {in[0].detach()};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Shape& xs = ctx.inputs[0].shape;
    const Shape kshape = reduced_shape(xs, dims_, true);
    Tensor g = reshape(ctx.grads[0], kshape);
    switch (op_) {
      case ReduceOp::sum: return {expand(g, xs)};
      case ReduceOp::sum_squares: return {expand(g, xs) * saved_[0] * 2.0};
      case ReduceOp::max:
      case ReduceOp::min: {
        Tensor hit = cast(eq(saved_[0], reshape(saved_[1], kshape)), g.dtype());
        Tensor count = sum(hit, dims_, true);
        return {hit * (g / count)};
      }
      default: fail("[", name(), "] is not differentiable");
    }
  }
  bool differentiable_output(size_t, const Tensor& out) const override {
    return op_ != ReduceOp::argmax && is_floating(out.dtype());
  }
  Attrs attrs() const override { return {{"dims", dims_}, {"keepdim", keepdim_}}; }

 private:
  // Checks that x can be reduced over dims_ and allocates the output.
  Tensor output_for(const Tensor& x) const {
    DType odt = x.dtype();
    if (op_ == ReduceOp::argmax) odt = DType::i64;
    else if ((op_ == ReduceOp::sum || op_ == ReduceOp::sum_squares) && !is_floating(x.dtype())) odt = DType::i64;
    if (op_ == ReduceOp::max || op_ == ReduceOp::min) {
      for (int64_t d : dims_)
        QUILT_CHECK(x.shape()[size_t(d)] > 0, "[", name(), "] cannot reduce an empty dim ", d, " of shape ", x.shape());
    }
    QUILT_CHECK(op_ != ReduceOp::argmax || x.numel() > 0, "[argmax] of an empty tensor");
    return Tensor::empty(reduced_shape(x.shape(), dims_, keepdim_), {.dtype = odt, .device = x.device()});
  }

  ReduceOp op_;
  Shape dims_;
  bool keepdim_;
};

Tensor run(ReduceOp op, const Tensor& x, const Shape& dims, bool keepdim, const char* name) {
  return apply1(std::make_shared<Reduce>(op, normalize_dims(dims, x.dim(), name), keepdim), {x});
}

}  // namespace

Tensor sum(const Tensor& x, const Shape& dims, bool keepdim) { return run(ReduceOp::sum, x, dims, keepdim, "sum"); }

Tensor mean(const Tensor& x, const Shape& dims, bool keepdim) {
  QUILT_CHECK(is_floating(x.dtype()), "[mean] needs a floating tensor, got ", dtype_name(x.dtype()));
  const Shape nd = normalize_dims(dims, x.dim(), "mean");
  int64_t count = 1;
  for (int64_t d : nd) count *= x.shape()[size_t(d)];
  return sum(x, dims, keepdim) * (1.0 / double(count));
}

Tensor max(const Tensor& x, const Shape& dims, bool keepdim) { return run(ReduceOp::max, x, dims, keepdim, "max"); }
Tensor min(const Tensor& x, const Shape& dims, bool keepdim) { return run(ReduceOp::min, x, dims, keepdim, "min"); }

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  return run(ReduceOp::argmax, x, {wrap_dim(dim, x.dim(), "argmax")}, keepdim, "argmax");
}

Tensor argmax(const Tensor& x) { return argmax(reshape(x, {-1}), 0, false); }

Tensor sum_squares(const Tensor& x) { return run(ReduceOp::sum_squares, x, {}, false, "sum_squares"); }

}  // namespace quilt
