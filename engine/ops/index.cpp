// Indexing, joining and ordering ops. Primitives with a CPU kernel (kernels/cpu/index.cpp):
// gather, scatter_add, index_select, index_add, sort/topk, cumsum — each backward written
// with the others (gather <-> scatter_add, index_select <-> index_add, sort/topk scatter the
// gradient back through their indices, cumsum <-> reversed cumsum). cat is a primitive too,
// but its forward is empty + copy_ into narrow views, so it runs on any device. stack, split,
// chunk, argsort and one_hot are compositions of other ops.
//
// CUDA kernels (kernels/cuda/nn.h) run all six primitives. Index ranges are checked on the host
// for CPU indices; checking CUDA ones there would copy them back and synchronise inside the op.
// On the device an out-of-range index reads zero (gather, index_select) or is skipped
// (scatter_add, index_add), never a wild memory access, and the kernel reports it: the next
// synchronisation with the device throws naming the op, the index and the dim's size
// (kernels::cuda::DeviceError). CUDA sort/topk takes rows of at most kSortMaxRow elements.
#include "engine/ops/index.h"

#include <array>

#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/dispatch.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"
#include "kernels/cpu/index.h"
#include "kernels/cuda/nn.h"

namespace quilt {
namespace {

using kernels::cuda::DeviceErrorOp;

// Kernels see a 0-d tensor as one element of a 1-D tensor.
Shape dims_of(const Tensor& t) { return t.dim() ? t.shape() : Shape{1}; }
Shape strides_of(const Tensor& t) { return t.dim() ? t.strides() : Shape{0}; }

void check_index_dtype(const char* op, const Tensor& index) {
  QUILT_CHECK(index.defined(), "[", op, "] index is an undefined tensor");
  QUILT_CHECK(index.dtype() == DType::i32 || index.dtype() == DType::i64, "[", op,
              "] index must be an i32 or i64 tensor, got ", dtype_name(index.dtype()));
}

// Throws naming the op, the first offending extreme and the dim's size unless every index
// lies in [0, size). CPU indices only (see the top of this file); device kernels bound them.
void check_index_range(const char* op, const Tensor& index, int64_t dim, int64_t size) {
  auto loop = ops::loop_over<1>(index.shape(), {&index});
  int64_t lo = 0, hi = 0;
  if (!kernels::cpu::index_range(index.dtype(), loop, &lo, &hi)) return;
  if (lo < 0) fail("[", op, "] index ", lo, " is out of range for dim ", dim, " of size ", size);
  if (hi >= size) fail("[", op, "] index ", hi, " is out of range for dim ", dim, " of size ", size);
}

kernels::Loop<3> make_loop3(const Shape& shape, const std::array<Shape, 3>& strides, const std::array<void*, 3>& data) {
  QUILT_CHECK(shape.size() <= size_t(kernels::kMaxDims), "[index] tensors of more than ", kernels::kMaxDims,
              " dims are not supported, got shape ", shape);
  const int64_t* sp[3] = {strides[0].data(), strides[1].data(), strides[2].data()};
  void* dp[3] = {data[0], data[1], data[2]};
  return kernels::make_loop<3>(int(shape.size()), shape.data(), sp, dp);
}

// The kernels' loop for out[p] = x[p with dim := index[p]] over every position p of a non-empty
// out; `istr` are index's strides seen at out's shape (0 where index_select broadcasts its 1-D index).
kernels::IndexLoop gather_loop(const Tensor& x, int64_t dim, const Tensor& index, const Shape& istr,
                               const Tensor& out) {
  Shape xs = strides_of(x);
  kernels::IndexLoop l;
  l.self_dim_stride = xs[size_t(dim)];
  xs[size_t(dim)] = 0;
  l.loop = make_loop3(dims_of(out), {xs, istr, strides_of(out)}, {x.data_ptr(), index.data_ptr(), out.data_ptr()});
  return l;
}

// The kernels' loop for self[p with dim := index[p]] += src[p] over every position p of a
// non-empty src.
kernels::IndexLoop scatter_add_loop(const Tensor& self, int64_t dim, const Tensor& index, const Shape& istr,
                                    const Tensor& src) {
  Shape shape = dims_of(src), ss = strides_of(self), srs = strides_of(src);
  kernels::IndexLoop l;
  l.n = shape[size_t(dim)];
  l.self_dim_stride = ss[size_t(dim)];
  l.index_dim_stride = istr[size_t(dim)];
  l.other_dim_stride = srs[size_t(dim)];
  shape[size_t(dim)] = 1;  // walked by the kernel in order, outside the loop
  l.loop = make_loop3(shape, {ss, istr, srs}, {self.data_ptr(), index.data_ptr(), src.data_ptr()});
  return l;
}

// The op a device kernel names when it meets an out-of-range index; none when the indices were
// checked already (a backward re-using its forward's).
DeviceErrorOp report_as(bool check, DeviceErrorOp op) { return check ? op : DeviceErrorOp::none; }

// index_select/index_add see their 1-D index as a tensor of `ndim` dims that varies only along dim.
Shape broadcast_index_strides(const Tensor& index, size_t ndim, int64_t dim) {
  Shape s(std::max<size_t>(ndim, 1), 0);
  s[size_t(dim)] = index.dim() ? index.stride(0) : 0;
  return s;
}

Tensor copy_of(const Tensor& x) {
  Tensor out = Tensor::empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  out.copy_(x);
  return out;
}

Tensor zeros_for(const TensorMeta& m, const Tensor& g) { return zeros(m.shape, {.dtype = g.dtype(), .device = g.device()}); }

Tensor run_gather(const Tensor& x, int64_t dim, const Tensor& index, bool check);
Tensor run_scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src, bool check);
Tensor run_index_select(const Tensor& x, int64_t dim, const Tensor& index, bool check);
Tensor run_index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src, bool check);

// `check` is false when a backward re-uses indices its forward already validated.
class Gather final : public Primitive {
 public:
  Gather(int64_t dim, bool check) : dim_(dim), check_(check) {}
  const char* name() const override { return "gather"; }
  Attrs attrs() const override { return {{"dim", dim_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor &x = in[0], &index = in[1];
    if (check_) check_index_range(name(), index, dim_, dims_of(x)[size_t(dim_)]);
    Tensor out = output_for(x, index);
    if (out.numel() > 0)
      kernels::cpu::gather(x.dtype(), index.dtype(), gather_loop(x, dim_, index, strides_of(index), out));
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor &x = in[0], &index = in[1];
    Tensor out = output_for(x, index);
    if (out.numel() > 0)
      kernels::cuda::gather(x.dtype(), index.dtype(), gather_loop(x, dim_, index, strides_of(index), out),
                            dims_of(x)[size_t(dim_)], report_as(check_, DeviceErrorOp::gather),
                            ops::stream_handle(x.device()));
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[1].detach()}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    return {run_scatter_add(zeros_for(ctx.inputs[0], g), dim_, saved_[0], g, false), Tensor()};
  }

 private:
  static Tensor output_for(const Tensor& x, const Tensor& index) {
    return Tensor::empty(index.shape(), {.dtype = x.dtype(), .device = x.device()});
  }

  int64_t dim_;
  bool check_;
};

class ScatterAdd final : public Primitive {
 public:
  ScatterAdd(int64_t dim, bool check) : dim_(dim), check_(check) {}
  const char* name() const override { return "scatter_add"; }
  Attrs attrs() const override { return {{"dim", dim_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor &x = in[0], &index = in[1], &src = in[2];
    if (check_) check_index_range(name(), index, dim_, dims_of(x)[size_t(dim_)]);
    Tensor out = copy_of(x);
    if (src.numel() > 0)
      kernels::cpu::scatter_add(out.dtype(), index.dtype(), scatter_add_loop(out, dim_, index, strides_of(index), src));
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor &x = in[0], &index = in[1], &src = in[2];
    Tensor out = copy_of(x);
    if (src.numel() > 0)
      kernels::cuda::scatter_add(out.dtype(), index.dtype(), scatter_add_loop(out, dim_, index, strides_of(index), src),
                                 dims_of(out)[size_t(dim_)], report_as(check_, DeviceErrorOp::scatter_add),
                                 ops::stream_handle(out.device()));
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[1].detach()}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    Tensor gsrc = ctx.needs[2] ? run_gather(g, dim_, saved_[0], false) : Tensor();
    return {g, Tensor(), gsrc};
  }

 private:
  int64_t dim_;
  bool check_;
};

class IndexSelect final : public Primitive {
 public:
  IndexSelect(int64_t dim, bool check) : dim_(dim), check_(check) {}
  const char* name() const override { return "index_select"; }
  Attrs attrs() const override { return {{"dim", dim_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor &x = in[0], &index = in[1];
    if (check_) check_index_range(name(), index, dim_, x.size(dim_));
    Tensor out = output_for(x, index);
    if (out.numel() > 0) kernels::cpu::gather(x.dtype(), index.dtype(), loop(x, index, out));
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor &x = in[0], &index = in[1];
    Tensor out = output_for(x, index);
    if (out.numel() > 0)
      kernels::cuda::gather(x.dtype(), index.dtype(), loop(x, index, out), dims_of(x)[size_t(dim_)],
                            report_as(check_, DeviceErrorOp::index_select), ops::stream_handle(x.device()));
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[1].detach()}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    return {run_index_add(zeros_for(ctx.inputs[0], g), dim_, saved_[0], g, false), Tensor()};
  }

 private:
  Tensor output_for(const Tensor& x, const Tensor& index) const {
    Shape shape = x.shape();
    shape[size_t(dim_)] = index.numel();
    return Tensor::empty(shape, {.dtype = x.dtype(), .device = x.device()});
  }
  kernels::IndexLoop loop(const Tensor& x, const Tensor& index, const Tensor& out) const {
    return gather_loop(x, dim_, index, broadcast_index_strides(index, size_t(out.dim()), dim_), out);
  }

  int64_t dim_;
  bool check_;
};

class IndexAdd final : public Primitive {
 public:
  IndexAdd(int64_t dim, bool check) : dim_(dim), check_(check) {}
  const char* name() const override { return "index_add"; }
  Attrs attrs() const override { return {{"dim", dim_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor &x = in[0], &index = in[1], &src = in[2];
    if (check_) check_index_range(name(), index, dim_, x.size(dim_));
    Tensor out = copy_of(x);
    if (src.numel() > 0) kernels::cpu::scatter_add(out.dtype(), index.dtype(), loop(out, index, src));
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor &x = in[0], &index = in[1], &src = in[2];
    Tensor out = copy_of(x);
    if (src.numel() > 0)
      kernels::cuda::scatter_add(out.dtype(), index.dtype(), loop(out, index, src), dims_of(out)[size_t(dim_)],
                                 report_as(check_, DeviceErrorOp::index_add), ops::stream_handle(out.device()));
    return {out};
  }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override { saved_ = {in[1].detach()}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    Tensor gsrc = ctx.needs[2] ? run_index_select(g, dim_, saved_[0], false) : Tensor();
    return {g, Tensor(), gsrc};
  }

 private:
  kernels::IndexLoop loop(const Tensor& out, const Tensor& index, const Tensor& src) const {
    return scatter_add_loop(out, dim_, index, broadcast_index_strides(index, size_t(src.dim()), dim_), src);
  }

  int64_t dim_;
  bool check_;
};

// Inputs share dtype, device and every size but dim's (checked by cat()).
class Cat final : public AnyDevicePrimitive {
 public:
  explicit Cat(int64_t dim) : dim_(dim) {}
  const char* name() const override { return "cat"; }
  Attrs attrs() const override { return {{"dim", dim_}}; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    Shape shape = in[0].shape();
    int64_t total = 0;
    for (const Tensor& t : in) total += t.size(dim_);
    shape[size_t(dim_)] = total;
    Tensor out = Tensor::empty(shape, {.dtype = in[0].dtype(), .device = in[0].device()});
    int64_t off = 0;
    for (const Tensor& t : in) {
      const int64_t n = t.size(dim_);
      if (n > 0) {
        Tensor window = narrow(out, dim_, off, n);  // out needs no grad: this records nothing
        window.copy_(t);
      }
      off += n;
    }
    return {out};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    std::vector<Tensor> gi(ctx.inputs.size());
    int64_t off = 0;
    for (size_t i = 0; i < gi.size(); ++i) {
      const int64_t n = ctx.inputs[i].shape[size_t(dim_)];
      if (ctx.needs[i]) gi[i] = narrow(g, dim_, off, n);
      off += n;
    }
    return gi;
  }

 private:
  int64_t dim_;
};

// Sort along dim; with k < n only the first k of each sorted row (top-k).
class Sort final : public Primitive {
 public:
  Sort(const char* name, int64_t dim, int64_t k, bool descending) : name_(name), dim_(dim), k_(k), descending_(descending) {}
  const char* name() const override { return name_; }
  Attrs attrs() const override { return {{"dim", dim_}, {"k", k_}, {"descending", descending_}}; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    std::vector<Tensor> out = outputs_for(x);
    if (out[0].numel() > 0) kernels::cpu::sort(x.dtype(), loop(x, out), descending_);
    return out;
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    std::vector<Tensor> out = outputs_for(x);
    if (out[0].numel() == 0) return out;
    const kernels::RowLoop l = loop(x, out);
    QUILT_CHECK(l.n <= kernels::cuda::kSortMaxRow, "[", name(), "] on CUDA sorts rows of at most ",
                kernels::cuda::kSortMaxRow, " elements, got ", l.n, " along dim ", dim_, " of shape ", x.shape());
    kernels::cuda::sort(x.dtype(), l, descending_, ops::stream_handle(x.device()));
    return out;
  }
  void save(const std::vector<Tensor>&, const std::vector<Tensor>& out) override { saved_ = {out[1].detach()}; }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    return {run_scatter_add(zeros_for(ctx.inputs[0], g), dim_, saved_[0], g, false)};
  }
  bool differentiable_output(size_t i, const Tensor& out) const override { return i == 0 && is_floating(out.dtype()); }

 private:
  // (values, indices), k_ along dim_.
  std::vector<Tensor> outputs_for(const Tensor& x) const {
    Shape shape = x.shape();
    if (x.dim()) shape[size_t(dim_)] = k_;
    return {Tensor::empty(shape, {.dtype = x.dtype(), .device = x.device()}),
            Tensor::empty(shape, {.dtype = DType::i64, .device = x.device()})};
  }
  // The kernels' rows of x along dim_, writing the first k_ of each into out = (values, indices).
  kernels::RowLoop loop(const Tensor& x, const std::vector<Tensor>& out) const {
    Shape rows = dims_of(x);
    kernels::RowLoop l;
    l.n = rows[size_t(dim_)];
    l.k = k_;
    const std::array<Shape, 3> st = {strides_of(out[0]), strides_of(out[1]), strides_of(x)};
    for (size_t i = 0; i < 3; ++i) l.dim_strides[i] = st[i][size_t(dim_)];
    rows[size_t(dim_)] = 1;
    l.rows = make_loop3(rows, st, {out[0].data_ptr(), out[1].data_ptr(), x.data_ptr()});
    return l;
  }

  const char* name_;
  int64_t dim_, k_;
  bool descending_;
};

// Running sum along dim, from the end when `reverse` (each is the other's backward).
class Cumsum final : public Primitive {
 public:
  Cumsum(int64_t dim, bool reverse) : dim_(dim), reverse_(reverse) {}
  const char* name() const override { return "cumsum"; }
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Tensor out = output_for(x);
    if (out.numel() > 0) kernels::cpu::cumsum(x.dtype(), out.dtype(), loop(x, out), reverse_);
    return {out};
  }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    Tensor out = output_for(x);
    if (out.numel() > 0)
      kernels::cuda::cumsum(x.dtype(), out.dtype(), loop(x, out), reverse_, ops::stream_handle(x.device()));
    return {out};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    return {apply1(std::make_shared<Cumsum>(dim_, !reverse_), {ctx.grads[0]})};
  }

 private:
  static Tensor output_for(const Tensor& x) {
    const DType odt = is_floating(x.dtype()) ? x.dtype() : DType::i64;
    return Tensor::empty(x.shape(), {.dtype = odt, .device = x.device()});
  }
  // The kernels' rows of x along dim_, summed into out.
  kernels::RowLoop loop(const Tensor& x, const Tensor& out) const {
    Shape rows = dims_of(x);
    const Shape none(rows.size(), 0);
    const std::array<Shape, 3> st = {strides_of(out), none, strides_of(x)};
    kernels::RowLoop l;
    l.n = l.k = rows[size_t(dim_)];
    for (size_t i = 0; i < 3; ++i) l.dim_strides[i] = st[i][size_t(dim_)];
    rows[size_t(dim_)] = 1;
    l.rows = make_loop3(rows, st, {out.data_ptr(), nullptr, x.data_ptr()});
    return l;
  }

  int64_t dim_;
  bool reverse_;
};

// ---- argument checks shared by the public functions and the backward paths ----

void check_same_rank(const char* op, const char* a_name, const Tensor& a, const char* b_name, const Tensor& b) {
  QUILT_CHECK(a.dim() == b.dim(), "[", op, "] ", a_name, " shape ", a.shape(), " and ", b_name, " shape ", b.shape(),
              " differ in rank");
}

// index.size(d) <= x.size(d) for every d but dim.
void check_index_fits(const char* op, const Tensor& x, const Tensor& index, int64_t dim) {
  for (int64_t d = 0; d < x.dim(); ++d)
    QUILT_CHECK(d == dim || index.size(d) <= x.size(d), "[", op, "] index shape ", index.shape(),
                " is larger than x shape ", x.shape(), " in dim ", d, " (only dim ", dim, " may differ)");
}

// Brings two float/int operands to their promoted dtype (bool is not summable).
std::pair<Tensor, Tensor> promote_pair(const char* op, const Tensor& x, const Tensor& src) {
  const DType dt = promote_types(x.dtype(), src.dtype());
  QUILT_CHECK(dt != DType::b8, "[", op, "] is not defined for bool tensors");
  return {cast(x, dt), cast(src, dt)};
}

Tensor run_gather(const Tensor& x, int64_t dim, const Tensor& index, bool check) {
  return apply1(std::make_shared<Gather>(dim, check), {x, index});
}
Tensor run_scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src, bool check) {
  return apply1(std::make_shared<ScatterAdd>(dim, check), {x, index, src});
}
Tensor run_index_select(const Tensor& x, int64_t dim, const Tensor& index, bool check) {
  return apply1(std::make_shared<IndexSelect>(dim, check), {x, index});
}
Tensor run_index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src, bool check) {
  return apply1(std::make_shared<IndexAdd>(dim, check), {x, index, src});
}

void check_index_1d(const char* op, const Tensor& x, const Tensor& index) {
  check_index_dtype(op, index);
  QUILT_CHECK(x.dim() >= 1, "[", op, "] needs a tensor of at least 1 dim, got shape ", x.shape());
  QUILT_CHECK(index.dim() <= 1, "[", op, "] index must be 0-d or 1-D, got shape ", index.shape());
}

}  // namespace

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  check_index_dtype("gather", index);
  dim = wrap_dim(dim, x.dim(), "gather");
  check_same_rank("gather", "x", x, "index", index);
  check_index_fits("gather", x, index, dim);
  return run_gather(x, dim, index, true);
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  check_index_dtype("scatter_add", index);
  dim = wrap_dim(dim, x.dim(), "scatter_add");
  check_same_rank("scatter_add", "x", x, "index", index);
  QUILT_CHECK(index.shape() == src.shape(), "[scatter_add] index shape ", index.shape(), " and src shape ", src.shape(),
              " must be equal");
  check_index_fits("scatter_add", x, index, dim);
  auto [xx, ss] = promote_pair("scatter_add", x, src);
  return run_scatter_add(xx, dim, index, ss, true);
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  check_index_1d("index_select", x, index);
  dim = wrap_dim(dim, x.dim(), "index_select");
  return run_index_select(x, dim, index, true);
}

Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src) {
  check_index_1d("index_add", x, index);
  dim = wrap_dim(dim, x.dim(), "index_add");
  Shape want = x.shape();
  want[size_t(dim)] = index.numel();
  QUILT_CHECK(src.shape() == want, "[index_add] src shape ", src.shape(), " does not match x shape ", x.shape(),
              " with dim ", dim, " of size ", index.numel(), " (the index length)");
  auto [xx, ss] = promote_pair("index_add", x, src);
  return run_index_add(xx, dim, index, ss, true);
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  QUILT_CHECK(!xs.empty(), "[cat] needs at least one tensor");
  for (size_t i = 0; i < xs.size(); ++i) QUILT_CHECK(xs[i].defined(), "[cat] tensor ", i, " is undefined");
  const Tensor& first = xs[0];
  QUILT_CHECK(first.dim() >= 1, "[cat] cannot concatenate 0-d tensors (use stack)");
  dim = wrap_dim(dim, first.dim(), "cat");
  common_device("cat", xs);
  DType dt = first.dtype();
  for (size_t i = 1; i < xs.size(); ++i) {
    const Tensor& t = xs[i];
    bool ok = t.dim() == first.dim();
    for (int64_t d = 0; ok && d < t.dim(); ++d) ok = d == dim || t.size(d) == first.size(d);
    QUILT_CHECK(ok, "[cat] tensor ", i, " has shape ", t.shape(), " but tensor 0 has shape ", first.shape(),
                "; sizes must match except in dim ", dim);
    dt = promote_types(dt, t.dtype());
  }
  std::vector<Tensor> in;
  in.reserve(xs.size());
  for (const Tensor& t : xs) in.push_back(cast(t, dt));
  return apply1(std::make_shared<Cat>(dim), in);
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim) {
  QUILT_CHECK(!xs.empty(), "[stack] needs at least one tensor");
  for (size_t i = 0; i < xs.size(); ++i) {
    QUILT_CHECK(xs[i].defined(), "[stack] tensor ", i, " is undefined");
    QUILT_CHECK(xs[i].shape() == xs[0].shape(), "[stack] tensor ", i, " has shape ", xs[i].shape(),
                " but tensor 0 has shape ", xs[0].shape(), "; all shapes must be equal");
  }
  dim = wrap_dim(dim, xs[0].dim() + 1, "stack");
  std::vector<Tensor> parts;
  parts.reserve(xs.size());
  for (const Tensor& t : xs) parts.push_back(unsqueeze(t, dim));
  return cat(parts, dim);
}

std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim) {
  QUILT_CHECK(x.dim() >= 1, "[split] cannot split a 0-d tensor");
  dim = wrap_dim(dim, x.dim(), "split");
  const int64_t n = x.size(dim);
  QUILT_CHECK(size > 0 || (size == 0 && n == 0), "[split] piece size must be positive, got ", size, " for dim ", dim,
              " of shape ", x.shape());
  if (n == 0) return {narrow(x, dim, 0, 0)};
  std::vector<Tensor> out;
  for (int64_t start = 0; start < n; start += size) out.push_back(narrow(x, dim, start, std::min(size, n - start)));
  return out;
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  QUILT_CHECK(x.dim() >= 1, "[split] cannot split a 0-d tensor");
  dim = wrap_dim(dim, x.dim(), "split");
  int64_t total = 0;
  for (int64_t s : sizes) {
    QUILT_CHECK(s >= 0, "[split] negative piece size in ", sizes);
    total += s;
  }
  QUILT_CHECK(total == x.size(dim), "[split] sizes ", sizes, " add up to ", total, ", but dim ", dim, " of shape ",
              x.shape(), " has size ", x.size(dim));
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(narrow(x, dim, start, s));
    start += s;
  }
  return out;
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  QUILT_CHECK(chunks > 0, "[chunk] number of chunks must be positive, got ", chunks);
  QUILT_CHECK(x.dim() >= 1, "[chunk] cannot chunk a 0-d tensor");
  dim = wrap_dim(dim, x.dim(), "chunk");
  const int64_t n = x.size(dim);
  // An empty dim still yields `chunks` (empty) pieces, so callers can rely on the count.
  if (n == 0) return split(x, std::vector<int64_t>(size_t(chunks), 0), dim);
  return split(x, (n + chunks - 1) / chunks, dim);
}

std::pair<Tensor, Tensor> topk(const Tensor& x, int64_t k, int64_t dim, bool largest) {
  dim = wrap_dim(dim, x.dim(), "topk");
  const int64_t n = dims_of(x)[size_t(dim)];
  QUILT_CHECK(x.dim() > 0 || k == 1, "[topk] k must be 1 for a 0-d tensor, got ", k);
  QUILT_CHECK(k >= 0 && k <= n, "[topk] k ", k, " out of range for dim ", dim, " of size ", n, " (shape ", x.shape(), ")");
  auto outs = apply(std::make_shared<Sort>("topk", dim, k, largest), {x});
  return {outs[0], outs[1]};
}

std::pair<Tensor, Tensor> sort(const Tensor& x, int64_t dim, bool descending) {
  dim = wrap_dim(dim, x.dim(), "sort");
  auto outs = apply(std::make_shared<Sort>("sort", dim, dims_of(x)[size_t(dim)], descending), {x});
  return {outs[0], outs[1]};
}

Tensor argsort(const Tensor& x, int64_t dim, bool descending) { return sort(x, dim, descending).second; }

Tensor cumsum(const Tensor& x, int64_t dim) {
  dim = wrap_dim(dim, x.dim(), "cumsum");
  return apply1(std::make_shared<Cumsum>(dim, false), {x});
}

Tensor one_hot(const Tensor& indices, int64_t num_classes, DType dtype) {
  check_index_dtype("one_hot", indices);
  QUILT_CHECK(num_classes >= -1, "[one_hot] num_classes must be -1 (infer) or non-negative, got ", num_classes);
  if (indices.numel() > 0) {
    // Reductions rather than a CPU kernel, so the check (and the op) works on every device.
    const int64_t lo = min(indices).item<int64_t>(), hi = max(indices).item<int64_t>();
    if (num_classes < 0) num_classes = hi + 1;
    if (lo < 0) fail("[one_hot] index ", lo, " is out of range for ", num_classes, " classes");
    if (hi >= num_classes) fail("[one_hot] index ", hi, " is out of range for ", num_classes, " classes");
  } else {
    QUILT_CHECK(num_classes >= 0, "[one_hot] cannot infer num_classes from an empty tensor of shape ", indices.shape());
  }
  Tensor classes = arange(0, double(num_classes), 1, {.dtype = indices.dtype(), .device = indices.device()});
  return cast(eq(unsqueeze(indices, -1), classes), dtype);
}

}  // namespace quilt
