// Factories and the loop helpers shared by engine/ops.
#include "engine/ops/creation.h"

#include <cmath>

#include "engine/autograd.h"
#include "engine/cuda_runtime.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cuda/kernels.h"

namespace quilt {

namespace ops {
Shape broadcast_strides(const Tensor& t, const Shape& shape) {
  const size_t n = shape.size(), m = size_t(t.dim());
  QUILT_CHECK(m <= n, "[broadcast] cannot broadcast shape ", t.shape(), " to ", shape);
  Shape st(n, 0);
  for (size_t i = 0; i < m; ++i) {
    const size_t o = n - m + i;
    const int64_t s = t.shape()[i];
    QUILT_CHECK(s == shape[o] || s == 1, "[broadcast] cannot broadcast shape ", t.shape(), " to ", shape);
    st[o] = (s == 1 && shape[o] != 1) ? 0 : t.strides()[i];
  }
  return st;
}

// True when `s` broadcasts to exactly `target` (NumPy rules, never growing target).
bool broadcasts_to(const Shape& s, const Shape& target) {
  if (s.size() > target.size()) return false;
  const size_t lead = target.size() - s.size();
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] != 1 && s[i] != target[lead + i]) return false;
  return true;
}

void* stream_handle(Device d) { return d.is_cuda() ? current_stream(d).handle : nullptr; }
}  // namespace ops

Tensor empty(const Shape& shape, TensorOptions opts) { return Tensor::empty(shape, opts); }

Tensor full(const Shape& shape, double value, TensorOptions opts) {
  const bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = Tensor::empty(shape, opts);
  t.fill_(value);
  if (rg) t.set_requires_grad(true);
  return t;
}
Tensor zeros(const Shape& shape, TensorOptions opts) { return full(shape, 0.0, opts); }
Tensor ones(const Shape& shape, TensorOptions opts) { return full(shape, 1.0, opts); }
Tensor scalar_tensor(double value, TensorOptions opts) { return full({}, value, opts); }
namespace {
// full_like as an op, so a distributed input gets a distributed result (the sharding rule
// keeps the input's layout); plain inputs skip the op machinery.
class FullLike final : public AnyDevicePrimitive {
 public:
  explicit FullLike(double v) : value_(v) {}
  const char* name() const override { return "full_like"; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    return {full(in[0].shape(), value_, {.dtype = in[0].dtype(), .device = in[0].device()})};
  }
  bool differentiable_output(size_t, const Tensor&) const override { return false; }
  Attrs attrs() const override { return {{"value", value_}}; }

 private:
  double value_;
};
}  // namespace

Tensor full_like(const Tensor& t, double v) {
  if (t.is_distributed()) {
    NoGradGuard ng;
    return apply1(std::make_shared<FullLike>(v), {t.detach()});
  }
  return full(t.shape(), v, {.dtype = t.dtype(), .device = t.device()});
}
Tensor zeros_like(const Tensor& t) { return full_like(t, 0.0); }
Tensor ones_like(const Tensor& t) { return full_like(t, 1.0); }
Tensor empty_like(const Tensor& t) {
  return t.is_distributed() ? full_like(t, 0.0) : empty(t.shape(), {.dtype = t.dtype(), .device = t.device()});
}

Tensor arange(double start, double end, double step, TensorOptions opts) {
  QUILT_CHECK(step != 0, "[arange] step must be non-zero");
  const int64_t n = std::max<int64_t>(0, int64_t(std::ceil((end - start) / step)));
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = start + double(i) * step;
  return from_vector(v, {n}, opts);
}

Tensor from_vector(const std::vector<double>& values, const Shape& shape, TensorOptions opts) {
  QUILT_CHECK(int64_t(values.size()) == numel_of(shape), "[from_vector] ", values.size(),
              " values do not fill shape ", shape);
  Tensor src = Tensor::from_storage(
      Storage::borrow(const_cast<double*>(values.data()), values.size() * sizeof(double), Device::cpu(), nullptr),
      shape, contiguous_strides(shape), 0, DType::f64);
  Tensor out = Tensor::empty(shape, {.dtype = opts.dtype, .device = opts.device});
  out.copy_(src);
  if (opts.requires_grad) out.set_requires_grad(true);
  return out;
}

namespace {
kernels::RandomArgs random_args(const Shape& shape, RngKey key, const GlobalView& view, double a, double b) {
  kernels::RandomArgs r;
  QUILT_CHECK(shape.size() <= size_t(kernels::kMaxDims), "[rand] too many dims: ", shape);
  const Shape& gshape = view.global_shape.empty() ? shape : view.global_shape;
  QUILT_CHECK(gshape.size() == shape.size(), "[rand] global shape ", gshape, " has a different rank than ", shape);
  const Shape gstr = contiguous_strides(gshape);
  r.ndim = int(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    r.shape[d] = shape[d];
    r.global_strides[d] = gstr[d];
    r.offsets[d] = view.offsets.empty() ? 0 : view.offsets[d];
    QUILT_CHECK(r.offsets[d] + shape[d] <= gshape[d], "[rand] block at offsets ", view.offsets, " of shape ", shape,
                " exceeds global shape ", gshape);
  }
  r.seed = key.seed;
  r.key = key.key;
  r.a = a;
  r.b = b;
  return r;
}

Tensor random_fill(const char* op, const Shape& shape, RngKey key, TensorOptions opts, double a, double b,
                   const GlobalView& view, bool normal) {
  QUILT_CHECK(is_floating(opts.dtype), "[", op, "] needs a floating dtype, got ", dtype_name(opts.dtype));
  const bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = Tensor::empty(shape, opts);
  const auto args = random_args(shape, key, view, a, b);
  if (t.device().is_cpu()) {
    normal ? kernels::cpu::random_normal(opts.dtype, t.data_ptr(), args)
           : kernels::cpu::random_uniform(opts.dtype, t.data_ptr(), args);
  } else {
    void* s = ops::stream_handle(t.device());
    normal ? kernels::cuda::random_normal(opts.dtype, t.data_ptr(), args, s)
           : kernels::cuda::random_uniform(opts.dtype, t.data_ptr(), args, s);
  }
  if (rg) t.set_requires_grad(true);
  return t;
}
}  // namespace

Tensor rand(const Shape& shape, RngKey key, TensorOptions opts, double low, double high, const GlobalView& view) {
  return random_fill("rand", shape, key, opts, low, high, view, false);
}

Tensor randn(const Shape& shape, RngKey key, TensorOptions opts, double mean, double std, const GlobalView& view) {
  return random_fill("randn", shape, key, opts, mean, std, view, true);
}

Tensor randint(int64_t low, int64_t high, const Shape& shape, RngKey key, TensorOptions opts) {
  QUILT_CHECK(high > low, "[randint] empty range [", low, ", ", high, ")");
  // Drawn where the tensor lives (the same numbers on every device).
  Tensor t = Tensor::empty(shape, {.dtype = opts.dtype, .device = opts.device});
  if (t.device().is_cpu()) kernels::cpu::random_int(opts.dtype, t.data_ptr(), t.numel(), low, high, key.seed, key.key);
  else
    kernels::cuda::random_int(opts.dtype, t.data_ptr(), t.numel(), low, high, key.seed, key.key,
                              ops::stream_handle(t.device()));
  return t;
}

Generator& default_generator() {
  thread_local Generator g(0);
  return g;
}
void manual_seed(uint64_t seed) { default_generator() = Generator(seed); }

}  // namespace quilt
