// Tensor accessors, shape helpers, printing; views and copies forward to engine/ops.
#include "engine/tensor.h"

#include <cmath>
#include <iomanip>
#include <numeric>
#include <sstream>

#include "engine/autograd.h"
#include "engine/ops/binary.h"
#include "engine/ops/matmul.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"

namespace quilt {

int64_t numel_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return st;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t n = std::max<int64_t>(ndim, 1);
  QUILT_CHECK(dim >= -n && dim < n, "[", op, "] dim ", dim, " out of range for a tensor of ", ndim, " dims");
  return dim < 0 ? dim + n : dim;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    QUILT_CHECK(da == db || da == 1 || db == 1, "[", op, "] shapes ", a, " and ", b, " do not broadcast");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor Tensor::from_storage(Storage storage, Shape shape, Shape strides, int64_t offset, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::empty(const Shape& shape, TensorOptions opts) {
  for (int64_t s : shape) QUILT_CHECK(s >= 0, "[empty] negative size in shape ", shape);
  const size_t bytes = size_t(numel_of(shape)) * dtype_size(opts.dtype);
  Storage st = opts.pinned && opts.device.is_cpu() ? Storage::allocate_pinned(bytes) : Storage::allocate(bytes, opts.device);
  Tensor t = from_storage(std::move(st), shape, contiguous_strides(shape), 0, opts.dtype);
  if (opts.requires_grad) t.set_requires_grad(true);
  return t;
}

int64_t Tensor::size(int64_t d) const { return shape()[size_t(wrap_dim(d, dim(), "size"))]; }
int64_t Tensor::stride(int64_t d) const { return strides()[size_t(wrap_dim(d, dim(), "stride"))]; }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  const auto& sh = shape();
  const auto& st = strides();
  for (size_t i = sh.size(); i-- > 0;) {
    if (sh[i] == 1) continue;
    if (sh[i] == 0) return true;
    if (st[i] != expected) return false;
    expected *= sh[i];
  }
  return true;
}

Tensor Tensor::make_distributed(const Tensor& local, std::shared_ptr<const DistSpec> spec, Shape global_shape) {
  QUILT_CHECK(local.defined() && !local.is_distributed(), "[distributed] the local shard must be an ordinary tensor");
  auto impl = std::make_shared<TensorImpl>();
  impl->strides = contiguous_strides(global_shape);
  impl->shape = std::move(global_shape);
  impl->dtype = local.dtype();
  impl->dist = std::move(spec);
  impl->local = local.impl_ptr();
  return Tensor(std::move(impl));
}

Tensor Tensor::local() const { return impl().local ? Tensor(impl().local) : *this; }

void* Tensor::data_ptr() const {
  QUILT_CHECK(!impl().local, "[data_ptr] distributed tensor of global shape ", shape(),
              " has no data of its own; use its local shard (to_local)");
  char* base = static_cast<char*>(impl().storage.data());
  return base ? base + impl().offset * int64_t(element_size()) : nullptr;
}

std::vector<double> Tensor::to_vector() const {
  QUILT_CHECK(!is_distributed(), "[to_vector] distributed tensor of global shape ", shape(),
              ": gather it first (full_tensor) or read its local shard");
  Tensor c = quilt::to(quilt::to(detach(), Device::cpu()), DType::f64).contiguous();
  const double* p = c.data<double>();
  return std::vector<double>(p, p + c.numel());
}

double Tensor::item_double() const {
  QUILT_CHECK(numel() == 1, "[item] needs a tensor of one element, got shape ", shape());
  return to_vector()[0];
}

// ---- autograd ----
bool Tensor::requires_grad() const { return impl().autograd && impl().autograd->requires_grad; }
bool Tensor::is_leaf() const { return !impl().autograd || !impl().autograd->grad_fn; }
const std::shared_ptr<Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<Node> none;
  return impl().autograd ? impl().autograd->grad_fn : none;
}
uint32_t Tensor::output_nr() const { return impl().autograd ? impl().autograd->output_nr : 0; }

Tensor& Tensor::set_requires_grad(bool r) {
  QUILT_CHECK(is_leaf(), "[requires_grad] can only be set on leaf tensors (this one has grad_fn ",
              grad_fn() ? "set" : "", ")");
  QUILT_CHECK(!r || is_floating(dtype()), "[requires_grad] only floating tensors can require grad, got ",
              dtype_name(dtype()));
  impl().meta().requires_grad = r;
  return *this;
}

Tensor Tensor::grad() const {
  if (!impl().autograd || !impl().autograd->grad) return {};
  return Tensor(impl().autograd->grad);
}

void Tensor::set_grad(const Tensor& g) {
  if (g.defined())
    QUILT_CHECK(g.shape() == shape(), "[set_grad] gradient shape ", g.shape(), " differs from tensor shape ", shape());
  impl().meta().grad = g.impl_;
}

Tensor Tensor::detach() const {
  auto impl2 = std::make_shared<TensorImpl>();
  impl2->storage = impl().storage;
  impl2->shape = impl().shape;
  impl2->strides = impl().strides;
  impl2->offset = impl().offset;
  impl2->dtype = impl().dtype;
  impl2->dist = impl().dist;
  impl2->local = impl().local;
  impl2->name = impl().name;
  return Tensor(std::move(impl2));
}

void Tensor::retain_grad() {
  if (is_leaf()) return;
  impl().meta().retains_grad = true;
  Node& n = *grad_fn();
  n.retain_output[output_nr()] = true;
  n.retained[output_nr()] = impl_;
}

void Tensor::backward(const Tensor& grad, bool retain_graph, bool create_graph) const {
  run_backward({*this}, {grad}, retain_graph, create_graph);
}

void Tensor::register_hook(GradHook hook) {
  QUILT_CHECK(requires_grad(), "[register_hook] the tensor does not require grad");
  if (is_leaf()) impl().meta().hooks.push_back(std::move(hook));
  else grad_fn()->output_hooks[output_nr()].push_back(std::move(hook));
}

void Tensor::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) {
  QUILT_CHECK(is_leaf() && requires_grad(),
              "[register_post_accumulate_grad_hook] only leaves that require grad accumulate gradients");
  impl().meta().post_accumulate_hooks.push_back(std::move(hook));
}

void Tensor::set_autograd(std::shared_ptr<Node> fn, uint32_t nr) {
  auto& m = impl().meta();
  m.grad_fn = std::move(fn);
  m.output_nr = nr;
  m.requires_grad = true;
}

// ---- forwarding ----
Tensor Tensor::view(const Shape& s) const { return quilt::view(*this, s); }
Tensor Tensor::reshape(const Shape& s) const { return quilt::reshape(*this, s); }
Tensor Tensor::permute(const Shape& d) const { return quilt::permute(*this, d); }
Tensor Tensor::transpose(int64_t a, int64_t b) const { return quilt::transpose(*this, a, b); }
Tensor Tensor::narrow(int64_t d, int64_t s, int64_t l) const { return quilt::narrow(*this, d, s, l); }
Tensor Tensor::slice(int64_t d, int64_t s, int64_t e, int64_t st) const { return quilt::slice(*this, d, s, e, st); }
Tensor Tensor::select(int64_t d, int64_t i) const { return quilt::select(*this, d, i); }
Tensor Tensor::expand(const Shape& s) const { return quilt::expand(*this, s); }
Tensor Tensor::squeeze(int64_t d) const { return quilt::squeeze(*this, d); }
Tensor Tensor::unsqueeze(int64_t d) const { return quilt::unsqueeze(*this, d); }
Tensor Tensor::flatten(int64_t s, int64_t e) const { return quilt::flatten(*this, s, e); }
Tensor Tensor::contiguous() const { return quilt::contiguous(*this); }
Tensor Tensor::to(DType dt) const { return quilt::to(*this, dt); }
Tensor Tensor::to(Device d, bool non_blocking) const { return quilt::to(*this, d, non_blocking); }
Tensor Tensor::clone() const { return quilt::clone(*this); }
Tensor Tensor::matmul(const Tensor& o) const { return quilt::matmul(*this, o); }
Tensor Tensor::sum() const { return quilt::sum(*this); }
Tensor Tensor::mean() const { return quilt::mean(*this); }

// ---- printing ----
namespace {
void print_values(std::ostringstream& os, const std::vector<double>& v, const Shape& shape, size_t dim,
                  int64_t offset, DType dt, int indent) {
  if (shape.empty()) {
    os << v[size_t(offset)];
    return;
  }
  const int64_t n = shape[dim];
  int64_t inner = 1;
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  os << '[';
  const bool abbreviate = n > 8;
  for (int64_t i = 0; i < n; ++i) {
    if (abbreviate && i == 3) {
      os << (dim + 1 == shape.size() ? "..., " : "...,\n" + std::string(size_t(indent + 1), ' '));
      i = n - 3;
    }
    if (dim + 1 == shape.size()) {
      const double x = v[size_t(offset + i)];
      if (is_floating(dt)) os << std::setprecision(6) << x;
      else if (dt == DType::b8) os << (x != 0 ? "true" : "false");
      else os << static_cast<int64_t>(x);
    } else {
      print_values(os, v, shape, dim + 1, offset + i * inner, dt, indent + 1);
    }
    if (i + 1 < n) os << (dim + 1 == shape.size() ? ", " : ",\n" + std::string(size_t(indent + 1), ' '));
  }
  os << ']';
}
}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  if (is_distributed()) {
    os << "DistributedTensor(shape=";
    detail::append(os, shape());
    os << ", dtype=" << dtype_name(dtype()) << ", local=" << local().str() << ')';
    return os.str();
  }
  os << "Tensor(";
  if (numel() <= 100000) {
    print_values(os, to_vector(), shape(), 0, 0, dtype(), 7);
    os << ", ";
  }
  os << "shape=";
  detail::append(os, shape());
  os << ", dtype=" << dtype_name(dtype()) << ", device=" << device().str();
  if (requires_grad()) os << ", requires_grad=true";
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace quilt
