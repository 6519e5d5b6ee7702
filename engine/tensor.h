// Tensor: a strided view of a Storage with a dtype and device, plus autograd metadata and,
// for distributed tensors, a DistSpec (defined by dtensor/; the engine only carries it).
//
//   Tensor a = randn({4, 8}, RngKey{0, "a"});
//   Tensor b = a.transpose(0, 1).contiguous();      // views share storage until contiguous()
//   Tensor y = (a.matmul(b)).sum();  y.backward();
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/device.h"
#include "engine/error.h"
#include "engine/storage.h"
#include "kernels/dtype.h"

namespace quilt {

using Shape = std::vector<int64_t>;

class Tensor;
class Node;
struct DistSpec;  // dtensor/: mesh + placements + global shape

/// Options for factories: `zeros({2, 3}, {.dtype = DType::f64})`.
struct TensorOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
  bool requires_grad = false;
  bool pinned = false;  // CPU only: page-locked memory, for fast asynchronous device copies
};

/// Hook run on the gradient flowing into a tensor; returns the gradient to use instead
/// (or an undefined Tensor to keep it).
using GradHook = std::function<Tensor(const Tensor& grad)>;
/// Hook run on a leaf after its .grad has been accumulated.
using PostAccumulateGradHook = std::function<void(Tensor& leaf)>;

/// Autograd state of a tensor (allocated on first use).
struct AutogradMeta {
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  uint32_t output_nr = 0;         // which output of grad_fn this is
  std::shared_ptr<struct TensorImpl> grad;
  std::weak_ptr<Node> grad_accumulator;  // leaves: their AccumulateGrad node
  std::vector<GradHook> hooks;           // leaves: run before accumulation
  std::vector<PostAccumulateGradHook> post_accumulate_hooks;
  bool retains_grad = false;
};

struct TensorImpl {
  Storage storage;
  Shape shape;
  Shape strides;  // in elements
  int64_t offset = 0;  // in elements
  DType dtype = DType::f32;
  std::unique_ptr<AutogradMeta> autograd;
  // Distributed tensors: `shape` is the global shape, there is no storage of its own, and
  // `local` is this rank's shard (an ordinary tensor). Set only together with `dist`.
  std::shared_ptr<const DistSpec> dist;
  std::shared_ptr<TensorImpl> local;
  std::string name;
  AutogradMeta& meta() {
    if (!autograd) autograd = std::make_unique<AutogradMeta>();
    return *autograd;
  }
};

/// Number of elements of a shape (1 for a scalar).
int64_t numel_of(const Shape& shape);
/// Row-major contiguous strides of a shape.
Shape contiguous_strides(const Shape& shape);
/// Normalises a possibly negative dim against ndim; `op` names the caller in the error.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
/// Shape two shapes broadcast to (NumPy rules); throws naming `op` and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

/// A reference-counted handle to a tensor. Copies share data and autograd state.
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  /// A tensor over an existing storage (no copy).
  static Tensor from_storage(Storage storage, Shape shape, Shape strides, int64_t offset, DType dtype);
  /// Uninitialised contiguous tensor.
  static Tensor empty(const Shape& shape, TensorOptions opts = {});

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t dim() const { return static_cast<int64_t>(impl().shape.size()); }
  /// Size of dim `d` (negative counts from the end).
  int64_t size(int64_t d) const;
  int64_t stride(int64_t d) const;
  int64_t numel() const { return numel_of(impl().shape); }
  int64_t offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().local ? impl().local->storage.device() : impl().storage.device(); }
  size_t element_size() const { return dtype_size(dtype()); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  bool is_contiguous() const;
  const Storage& storage() const { return impl().storage; }
  /// The tensor's memory is used on `s` too (Storage::record_stream); false when the caller
  /// must keep it alive until that use completes.
  bool record_stream(const Stream& s) const { return storage().record_stream(s); }
  /// In page-locked host memory (TensorOptions::pinned with CUDA present).
  bool is_pinned() const { return storage().is_pinned(); }
  /// Address of element 0 (storage base + offset).
  void* data_ptr() const;
  /// Typed pointer to element 0; throws if T does not match dtype().
  template <class T> T* data() const {
    QUILT_CHECK(dtype_of<T>() == dtype(), "[data] tensor is ", dtype_name(dtype()), ", asked for ",
                dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_ptr());
  }
  /// The single value of a one-element tensor, converted to T (copies from the device if needed).
  template <class T> T item() const { return static_cast<T>(item_double()); }
  double item_double() const;
  /// All values converted to double, in row-major order (copies from the device if needed).
  std::vector<double> to_vector() const;
  /// Optional name (parameters carry their dotted name).
  const std::string& name() const { return impl().name; }
  Tensor& set_name(std::string n) { impl().name = std::move(n); return *this; }
  /// Same tensor object (not just equal values).
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  TensorImpl* unsafe_impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  // ---- autograd ----
  bool requires_grad() const;
  /// Marks a leaf as needing gradients (error on non-leaves and non-float dtypes).
  Tensor& set_requires_grad(bool r = true);
  bool is_leaf() const;
  const std::shared_ptr<Node>& grad_fn() const;
  uint32_t output_nr() const;
  /// The accumulated gradient (undefined until a backward reaches this leaf).
  Tensor grad() const;
  void set_grad(const Tensor& g);
  /// Same data, cut from the graph.
  Tensor detach() const;
  /// Keeps .grad on a non-leaf after backward.
  void retain_grad();
  /// Backpropagates from this tensor (a scalar unless `grad` is given).
  void backward(const Tensor& grad = {}, bool retain_graph = false, bool create_graph = false) const;
  /// Registers a hook on the gradient w.r.t. this tensor.
  void register_hook(GradHook hook);
  /// Registers a hook that runs after this leaf's .grad was accumulated.
  void register_post_accumulate_grad_hook(PostAccumulateGradHook hook);
  void set_autograd(std::shared_ptr<Node> fn, uint32_t output_nr);

  // ---- distributed ----
  const std::shared_ptr<const DistSpec>& dist_spec() const { return impl().dist; }
  bool is_distributed() const { return impl_ && impl_->dist != nullptr; }
  /// A distributed tensor of global shape `global_shape` whose shard on this rank is `local`
  /// (dtensor/ builds these; the engine only carries them).
  static Tensor make_distributed(const Tensor& local, std::shared_ptr<const DistSpec> spec, Shape global_shape);
  /// This rank's shard of a distributed tensor; the tensor itself otherwise.
  Tensor local() const;

  // ---- views (share storage) ----
  Tensor view(const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;
  Tensor permute(const Shape& dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  /// Elements [start, start+length) of dim `d`.
  Tensor narrow(int64_t d, int64_t start, int64_t length) const;
  /// Elements start, start+step, ... < end of dim `d` (negative start/end count from the end).
  Tensor slice(int64_t d, int64_t start, int64_t end, int64_t step = 1) const;
  /// Index `i` of dim `d`, removing the dim.
  Tensor select(int64_t d, int64_t i) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze(int64_t d) const;
  Tensor unsqueeze(int64_t d) const;
  Tensor flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor contiguous() const;

  // ---- copies ----
  Tensor to(DType dtype) const;
  /// A copy on `device` (this tensor when already there). `non_blocking`: a copy between pinned
  /// host memory and a GPU is queued on the device's current stream without waiting (a copy to
  /// the host then lands in pinned memory, valid after that stream is synchronised); other
  /// copies wait as without it.
  Tensor to(Device device, bool non_blocking = false) const;
  Tensor clone() const;
  /// In-place: copies `src` (broadcast, cast, any device) into this tensor's elements.
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }
  /// In-place this += alpha * other (no autograd; optimizers and grad accumulation).
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  /// In-place this *= s.
  Tensor& mul_(double s);

  // ---- math shortcuts ----
  Tensor matmul(const Tensor& o) const;
  Tensor sum() const;
  Tensor mean() const;

  /// Human-readable rendering (shape, dtype, device, values; long tensors abbreviated).
  std::string str() const;

 private:
  TensorImpl& impl() const {
    QUILT_CHECK(impl_ != nullptr, "[tensor] use of an undefined tensor");
    return *impl_;
  }
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

}  // namespace quilt
