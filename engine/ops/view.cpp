// Views (alias storage; backward maps the gradient back), copies and casts, and the
// in-place Tensor methods used outside the graph (optimizers, gradient accumulation).
#include "engine/ops/view.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include "engine/autograd.h"
#include "engine/cuda_runtime.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/reduce.h"
#include "engine/primitive.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cuda/kernels.h"

namespace quilt {
namespace {

Tensor alias(const Tensor& x, Shape shape, Shape strides, int64_t offset) {
  return Tensor::from_storage(x.storage(), std::move(shape), std::move(strides), offset, x.dtype());
}

// Strides for viewing (shape, strides) as new_shape without copying, if possible.
std::optional<Shape> view_strides(Shape old_shape, Shape old_strides, const Shape& new_shape) {
  if (numel_of(old_shape) == 0) return contiguous_strides(new_shape);
  if (old_shape.empty()) { old_shape = {1}; old_strides = {1}; }
  Shape ns(new_shape.size());
  int64_t view_d = int64_t(new_shape.size()) - 1;
  int64_t chunk_base = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t td = int64_t(old_shape.size()) - 1; td >= 0; --td) {
    tensor_numel *= old_shape[size_t(td)];
    if (td == 0 || (old_shape[size_t(td - 1)] != 1 && old_strides[size_t(td - 1)] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[size_t(view_d)] == 1)) {
        ns[size_t(view_d)] = view_numel * chunk_base;
        view_numel *= new_shape[size_t(view_d)];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (td > 0) {
        chunk_base = old_strides[size_t(td - 1)];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return ns;
}

Shape infer_shape(const Shape& shape, int64_t numel, const char* op, const Shape& from) {
  Shape out = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      QUILT_CHECK(infer < 0, "[", op, "] only one dim may be -1 in ", shape);
      infer = int64_t(i);
    } else {
      QUILT_CHECK(out[i] >= 0, "[", op, "] invalid size in ", shape);
      known *= out[i];
    }
  }
  if (infer >= 0) {
    QUILT_CHECK(known != 0 && numel % known == 0, "[", op, "] cannot view shape ", from, " as ", shape);
    out[size_t(infer)] = numel / known;
  }
  QUILT_CHECK(numel_of(out) == numel, "[", op, "] cannot view shape ", from, " (", numel, " elements) as ", shape);
  return out;
}

class View final : public AnyDevicePrimitive {
 public:
  explicit View(Shape shape) : shape_(std::move(shape)) {}
  const char* name() const override { return "view"; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    auto st = view_strides(x.shape(), x.strides(), shape_);
    QUILT_CHECK(st.has_value(), "[view] shape ", x.shape(), " with strides ", x.strides(),
                " cannot be viewed as ", shape_, " without a copy (use reshape)");
    return {alias(x, shape_, *st, x.offset())};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override { return {reshape(ctx.grads[0], ctx.inputs[0].shape)}; }
  Attrs attrs() const override { return {{"shape", shape_}}; }

 private:
  Shape shape_;
};

class Permute final : public AnyDevicePrimitive {
 public:
  explicit Permute(Shape dims) : dims_(std::move(dims)) {}
  const char* name() const override { return "permute"; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Shape sh(dims_.size()), st(dims_.size());
    for (size_t i = 0; i < dims_.size(); ++i) {
      sh[i] = x.shape()[size_t(dims_[i])];
      st[i] = x.strides()[size_t(dims_[i])];
    }
    return {alias(x, sh, st, x.offset())};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    Shape inv(dims_.size());
    for (size_t i = 0; i < dims_.size(); ++i) inv[size_t(dims_[i])] = int64_t(i);
    return {permute(ctx.grads[0], inv)};
  }
  Attrs attrs() const override { return {{"dims", dims_}}; }

 private:
  Shape dims_;
};

class Expand final : public AnyDevicePrimitive {
 public:
  explicit Expand(Shape shape) : shape_(std::move(shape)) {}
  const char* name() const override { return "expand"; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    return {alias(x, shape_, ops::broadcast_strides(x, shape_), x.offset())};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override { return {sum_to(ctx.grads[0], ctx.inputs[0].shape)}; }
  Attrs attrs() const override { return {{"shape", shape_}}; }

 private:
  Shape shape_;
};

// The adjoint of slice: zeros of the input's shape with the gradient in the window. An op of
// its own so a distributed gradient routes through the dispatcher (rule: dtensor/rules/view.cpp).
class SliceBackward final : public AnyDevicePrimitive {
 public:
  SliceBackward(Shape shape, int64_t dim, int64_t start, int64_t step)
      : shape_(std::move(shape)), dim_(dim), start_(start), step_(step) {}
  const char* name() const override { return "slice_backward"; }
  Attrs attrs() const override { return {{"shape", shape_}, {"dim", dim_}, {"start", start_}, {"step", step_}}; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    const Tensor& g = in[0];
    Tensor out = zeros(shape_, {.dtype = g.dtype(), .device = g.device()});
    const int64_t len = g.size(dim_);
    if (len > 0 && g.numel() > 0) {
      NoGradGuard ng;
      Tensor window = slice(out, dim_, start_, start_ + (len - 1) * step_ + 1, step_);
      window.copy_(g);
    }
    return {out};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const int64_t len = ctx.inputs[0].shape[size_t(dim_)];
    return {slice(ctx.grads[0], dim_, start_, start_ + std::max<int64_t>(len - 1, 0) * step_ + 1, step_)};
  }

 private:
  Shape shape_;
  int64_t dim_, start_, step_;
};

class Slice final : public AnyDevicePrimitive {
 public:
  Slice(int64_t dim, int64_t start, int64_t len, int64_t step) : dim_(dim), start_(start), len_(len), step_(step) {}
  const char* name() const override { return "slice"; }
  Attrs attrs() const override { return {{"dim", dim_}, {"start", start_}, {"length", len_}, {"step", step_}}; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Shape sh = x.shape(), st = x.strides();
    const int64_t off = x.offset() + (len_ > 0 ? start_ * st[size_t(dim_)] : 0);
    sh[size_t(dim_)] = len_;
    st[size_t(dim_)] *= step_;
    return {alias(x, sh, st, off)};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    return {apply1(std::make_shared<SliceBackward>(ctx.inputs[0].shape, dim_, start_, step_), {ctx.grads[0]})};
  }

 private:
  int64_t dim_, start_, len_, step_;
};

// Contiguous copy, cast and device transfer share one primitive.
// A copy between pinned host memory and a GPU queued on the device's current stream, no wait:
// when both sides are contiguous, of one dtype and shape, and the host side is pinned. The host
// block is marked used by that stream, so its allocator reuses it only after the copy. False
// (nothing done) otherwise.
bool copy_without_waiting(Tensor& dst, const Tensor& src) {
  const bool to_device = src.device().is_cpu() && dst.device().is_cuda();
  const bool to_host = src.device().is_cuda() && dst.device().is_cpu();
  const Tensor& host = to_device ? src : dst;
  if (!(to_device || to_host) || !host.is_pinned() || src.dtype() != dst.dtype() || src.shape() != dst.shape() ||
      !src.is_contiguous() || !dst.is_contiguous())
    return false;
  const Device gpu = to_device ? dst.device() : src.device();
  const Stream s = current_stream(gpu);
  if (dst.nbytes() == 0) return true;
  cuda_rt::memcpy_async(dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                        to_device ? cuda_rt::CopyKind::host_to_device : cuda_rt::CopyKind::device_to_host, s);
  host.record_stream(s);
  return true;
}

class Copy final : public AnyDevicePrimitive {
 public:
  Copy(DType dtype, Device device, const char* name, bool non_blocking = false)
      : dtype_(dtype), device_(device), name_(name), non_blocking_(non_blocking) {}
  const char* name() const override { return name_; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    if (non_blocking_ && x.device() != device_ && x.numel() > 0) {
      // To the host: into pinned memory, so the copy can run while the host goes on.
      Tensor out = Tensor::empty(x.shape(), {.dtype = dtype_, .device = device_, .pinned = device_.is_cpu()});
      if (copy_without_waiting(out, x)) return {out};
    }
    Tensor out = Tensor::empty(x.shape(), {.dtype = dtype_, .device = device_});
    out.copy_(x);
    return {out};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    Tensor g = ctx.grads[0];
    if (g.device() != ctx.inputs[0].device) g = to(g, ctx.inputs[0].device);
    if (g.dtype() != ctx.inputs[0].dtype) g = cast(g, ctx.inputs[0].dtype);
    return {g};
  }
  bool differentiable_output(size_t, const Tensor& out) const override { return is_floating(out.dtype()); }
  Attrs attrs() const override {
    return {{"dtype", std::string(dtype_name(dtype_))}, {"device", device_.str()}};
  }

 private:
  DType dtype_;
  Device device_;
  const char* name_;
  bool non_blocking_;
};

void check_inplace(const Tensor& t, const char* op) {
  QUILT_CHECK(!(grad_enabled() && t.requires_grad()), "[", op,
              "] in-place update of a tensor that requires grad while grad mode is on (use NoGradGuard)");
}

// Copies between devices through contiguous staging on the side that needs it.
void copy_across_devices(Tensor& dst, const Tensor& src) {
  const size_t bytes = dst.nbytes();
  if (src.device().is_cpu()) {  // host -> device
    Tensor staged = contiguous(expand(cast(src, dst.dtype()), dst.shape()));
    Tensor target = dst.is_contiguous() ? dst : Tensor::empty(dst.shape(), {.dtype = dst.dtype(), .device = dst.device()});
    if (bytes) cuda_rt::memcpy_async(target.data_ptr(), staged.data_ptr(), bytes, cuda_rt::CopyKind::host_to_device,
                                     current_stream(dst.device()));
    synchronize(current_stream(dst.device()));  // the staging buffer dies with this scope
    if (!target.is_same(dst)) dst.copy_(target);
  } else if (dst.device().is_cpu()) {  // device -> host
    Tensor staged = contiguous(expand(cast(src, dst.dtype()), dst.shape()));
    Tensor target = dst.is_contiguous() ? dst : Tensor::empty(dst.shape(), {.dtype = dst.dtype()});
    if (bytes) cuda_rt::memcpy_async(target.data_ptr(), staged.data_ptr(), bytes, cuda_rt::CopyKind::device_to_host,
                                     current_stream(src.device()));
    synchronize(current_stream(src.device()));
    if (!target.is_same(dst)) dst.copy_(target);
  } else {  // device -> other device
    Tensor staged = contiguous(expand(cast(src, dst.dtype()), dst.shape()));
    Tensor target = dst.is_contiguous() ? dst : Tensor::empty(dst.shape(), {.dtype = dst.dtype(), .device = dst.device()});
    if (bytes) cuda_rt::memcpy_async(target.data_ptr(), staged.data_ptr(), bytes, cuda_rt::CopyKind::device_to_device,
                                     current_stream(src.device()));
    synchronize(current_stream(src.device()));
    if (!target.is_same(dst)) dst.copy_(target);
  }
}

}  // namespace

Tensor view(const Tensor& x, const Shape& shape) {
  const Shape s = infer_shape(shape, x.numel(), "view", x.shape());
  if (s == x.shape()) return x;
  return apply1(std::make_shared<View>(s), {x});
}

Tensor reshape(const Tensor& x, const Shape& shape) {
  const Shape s = infer_shape(shape, x.numel(), "reshape", x.shape());
  if (s == x.shape()) return x;
  if (view_strides(x.shape(), x.strides(), s)) return apply1(std::make_shared<View>(s), {x});
  return apply1(std::make_shared<View>(s), {contiguous(x)});
}

Tensor permute(const Tensor& x, const Shape& dims) {
  QUILT_CHECK(int64_t(dims.size()) == x.dim(), "[permute] got ", dims.size(), " dims for a tensor of shape ", x.shape());
  Shape d(dims.size());
  std::vector<bool> seen(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    d[i] = wrap_dim(dims[i], x.dim(), "permute");
    QUILT_CHECK(!seen[size_t(d[i])], "[permute] dim repeated in ", dims);
    seen[size_t(d[i])] = true;
  }
  bool identity = true;
  for (size_t i = 0; i < d.size(); ++i) identity = identity && d[i] == int64_t(i);
  if (identity) return x;
  return apply1(std::make_shared<Permute>(d), {x});
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  Shape dims(size_t(x.dim()));
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[size_t(wrap_dim(d0, x.dim(), "transpose"))], dims[size_t(wrap_dim(d1, x.dim(), "transpose"))]);
  return permute(x, dims);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  QUILT_CHECK(x.dim() > 0, "[slice] cannot slice a 0-d tensor");
  dim = wrap_dim(dim, x.dim(), "slice");
  QUILT_CHECK(step > 0, "[slice] step must be positive, got ", step);
  const int64_t n = x.shape()[size_t(dim)];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  const int64_t len = (end - start + step - 1) / step;
  if (start == 0 && len == n && step == 1) return x;
  return apply1(std::make_shared<Slice>(dim, start, len, step), {x});
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  dim = wrap_dim(dim, x.dim(), "narrow");
  const int64_t n = x.shape()[size_t(dim)];
  QUILT_CHECK(start >= 0 && length >= 0 && start + length <= n, "[narrow] range [", start, ", ", start + length,
              ") out of bounds for dim ", dim, " of size ", n);
  return slice(x, dim, start, start + length, 1);
}

Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  dim = wrap_dim(dim, x.dim(), "select");
  const int64_t n = x.shape()[size_t(dim)];
  QUILT_CHECK(index >= -n && index < n, "[select] index ", index, " out of range for dim ", dim, " of size ", n);
  if (index < 0) index += n;
  return squeeze(narrow(x, dim, index, 1), dim);
}

Tensor expand(const Tensor& x, const Shape& shape) {
  Shape s = shape;
  const int64_t lead = int64_t(s.size()) - x.dim();
  QUILT_CHECK(lead >= 0, "[expand] cannot expand shape ", x.shape(), " to fewer dims ", shape);
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == -1) {
      QUILT_CHECK(int64_t(i) >= lead, "[expand] -1 not allowed in new leading dims: ", shape);
      s[i] = x.shape()[i - size_t(lead)];
    }
  if (s == x.shape()) return x;
  (void)broadcast_shapes(x.shape(), s, "expand");
  for (size_t i = 0; i < s.size(); ++i)
    if (int64_t(i) >= lead)
      QUILT_CHECK(x.shape()[i - size_t(lead)] == s[i] || x.shape()[i - size_t(lead)] == 1, "[expand] cannot expand shape ",
                  x.shape(), " to ", shape);
  return apply1(std::make_shared<Expand>(s), {x});
}

Tensor broadcast_to(const Tensor& x, const Shape& shape) { return expand(x, shape); }

Tensor squeeze(const Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "squeeze");
  if (x.dim() == 0 || x.shape()[size_t(dim)] != 1) return x;
  Shape s = x.shape();
  s.erase(s.begin() + dim);
  return view(x, s);
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim() + 1, "unsqueeze");
  Shape s = x.shape();
  s.insert(s.begin() + dim, 1);
  return view(x, s);
}

Tensor flatten(const Tensor& x, int64_t start, int64_t end) {
  if (x.dim() == 0) return reshape(x, {1});
  start = wrap_dim(start, x.dim(), "flatten");
  end = wrap_dim(end, x.dim(), "flatten");
  QUILT_CHECK(start <= end, "[flatten] start dim ", start, " after end dim ", end);
  Shape s(x.shape().begin(), x.shape().begin() + start);
  int64_t m = 1;
  for (int64_t i = start; i <= end; ++i) m *= x.shape()[size_t(i)];
  s.push_back(m);
  s.insert(s.end(), x.shape().begin() + end + 1, x.shape().end());
  return reshape(x, s);
}

Tensor as_strided(const Tensor& x, const Shape& shape, const Shape& strides, int64_t offset) {
  QUILT_CHECK(shape.size() == strides.size(), "[as_strided] shape ", shape, " and strides ", strides, " differ in rank");
  int64_t last = offset;
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] > 0) last += (shape[i] - 1) * strides[i];
  QUILT_CHECK(offset >= 0 && (numel_of(shape) == 0 || size_t(last + 1) * x.element_size() <= x.storage().nbytes()),
              "[as_strided] view out of bounds of storage");
  return alias(x, shape, strides, offset);
}

Tensor contiguous(const Tensor& x) {
  if (x.is_contiguous()) return x;
  return apply1(std::make_shared<Copy>(x.dtype(), x.device(), "contiguous"), {x});
}

Tensor cast(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  return apply1(std::make_shared<Copy>(dtype, x.device(), "cast"), {x});
}
Tensor to(const Tensor& x, DType dtype) { return cast(x, dtype); }
Tensor to(const Tensor& x, Device device, bool non_blocking) {
  if (x.device() == device) return x;
  return apply1(std::make_shared<Copy>(x.dtype(), device, "to", non_blocking), {x});
}
Tensor clone(const Tensor& x) { return apply1(std::make_shared<Copy>(x.dtype(), x.device(), "clone"), {x}); }

// ---- in-place Tensor methods ----
// In-place ops on distributed tensors act on the local shards, which is right only when both
// sides share one layout; anything else needs a redistribute first.
void check_local_inplace(const char* op, const Tensor& self, const Tensor& other) {
  QUILT_CHECK(same_layout(self, other), "[", op, "] in-place between tensors of different layouts (",
              self.is_distributed() ? "distributed" : "plain", " and ", other.is_distributed() ? "distributed" : "plain",
              "); redistribute first");
}

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace(*this, "copy_");
  if (is_distributed() || src.is_distributed()) {
    check_local_inplace("copy_", *this, src);
    Tensor mine = local();
    mine.copy_(src.local());
    return *this;
  }
  if (numel() == 0) return *this;
  if (device() != src.device()) {
    copy_across_devices(*this, src);
    return *this;
  }
  auto loop = ops::loop_over<2>(shape(), {this, &src});
  if (device().is_cpu()) kernels::cpu::copy(dtype(), src.dtype(), loop);
  else kernels::cuda::copy(dtype(), src.dtype(), loop, ops::stream_handle(device()));
  return *this;
}

Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_");
  if (is_distributed()) {
    Tensor mine = local();
    mine.fill_(value);
    return *this;
  }
  if (numel() == 0) return *this;
  auto loop = ops::loop_over<1>(shape(), {this});
  if (device().is_cpu()) kernels::cpu::fill(dtype(), value, loop);
  else kernels::cuda::fill(dtype(), value, loop, ops::stream_handle(device()));
  return *this;
}

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  check_inplace(*this, "add_");
  if (is_distributed() || other.is_distributed()) {
    check_local_inplace("add_", *this, other);
    Tensor mine = local();
    mine.add_(other.local(), alpha);
    return *this;
  }
  NoGradGuard ng;
  Tensor o = other.dtype() == dtype() ? other.detach() : cast(other.detach(), dtype());
  if (alpha != 1.0) o = o * alpha;
  if (numel() == 0) return *this;
  QUILT_CHECK(device() == o.device(), "[add_] tensors on ", device().str(), " and ", o.device().str());
  auto loop = ops::loop_over<3>(shape(), {this, this, &o});
  if (device().is_cpu()) kernels::cpu::binary(kernels::BinaryOp::add, dtype(), loop);
  else kernels::cuda::binary(kernels::BinaryOp::add, dtype(), loop, ops::stream_handle(device()));
  return *this;
}

Tensor& Tensor::mul_(double s) {
  check_inplace(*this, "mul_");
  if (is_distributed()) {
    Tensor mine = local();
    mine.mul_(s);
    return *this;
  }
  if (numel() == 0) return *this;
  NoGradGuard ng;
  Tensor o = scalar_like(s, *this);
  auto loop = ops::loop_over<3>(shape(), {this, this, &o});
  if (device().is_cpu()) kernels::cpu::binary(kernels::BinaryOp::mul, dtype(), loop);
  else kernels::cuda::binary(kernels::BinaryOp::mul, dtype(), loop, ops::stream_handle(device()));
  return *this;
}

}  // namespace quilt
