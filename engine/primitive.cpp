// apply(): runs a primitive, records its graph node, routes distributed inputs.
#include "engine/primitive.h"

#include <mutex>

#include "engine/ops/creation.h"
#include "engine/ops/view.h"
#include "engine/trace.h"

namespace quilt {
namespace {

DistributedDispatch& dist_dispatch() {
  static DistributedDispatch fn;
  return fn;
}

DistributedZeros& dist_zeros() {
  static DistributedZeros fn;
  return fn;
}

TensorMeta meta_of(const Tensor& t) {
  if (!t.defined()) return {};
  return TensorMeta{t.shape(), t.dtype(), t.device(), t.dist_spec()};
}

class PrimitiveNode final : public Node {
 public:
  explicit PrimitiveNode(std::shared_ptr<Primitive> p) : prim_(std::move(p)), name_(prim_->name()) {}
  std::string name() const override { return name_; }
  void release() override { prim_.reset(); }
  bool partial() const override { return true; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    return apply_some(std::move(grads), std::vector<bool>(next.size(), true));
  }
  std::vector<Tensor> apply_some(std::vector<Tensor>&& grads, const std::vector<bool>& wanted) override {
    QUILT_CHECK(prim_ != nullptr, "[backward] trying to backward through the graph of '", name_,
                "' a second time; its saved tensors were freed (pass retain_graph=true the first time)");
    bool any = false;
    for (auto& g : grads) any = any || g.defined();
    if (!any) return std::vector<Tensor>(next.size());
    BackwardContext ctx;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) continue;
      if (outputs[i].dist) {
        QUILT_CHECK(static_cast<bool>(dist_zeros()), "[", name_, " backward] no distributed zeros factory installed");
        grads[i] = dist_zeros()(outputs[i]);
      } else {
        grads[i] = zeros(outputs[i].shape, {.dtype = outputs[i].dtype, .device = outputs[i].device});
      }
    }
    ctx.grads = std::move(grads);
    ctx.needs.resize(next.size());
    for (size_t i = 0; i < next.size(); ++i) ctx.needs[i] = next[i].fn != nullptr && wanted[i];
    ctx.inputs = inputs;
    ctx.outputs = outputs;
    trace::Scope scope;
    if (trace::enabled()) {
      scope.begin("op", name_ + " backward");
      scope.arg("grad shapes", trace::shapes_of(ctx.grads));
    }
    std::vector<Tensor> gi = prim_->backward(ctx);
    gi.resize(next.size());
    for (size_t i = 0; i < gi.size(); ++i) {
      if (!ctx.needs[i] || !gi[i].defined()) { gi[i] = Tensor(); continue; }
      QUILT_CHECK(gi[i].shape() == inputs[i].shape, "[", name_, " backward] gradient for input ", i, " has shape ",
                  gi[i].shape(), ", expected ", inputs[i].shape);
      if (gi[i].dtype() != inputs[i].dtype) gi[i] = cast(gi[i], inputs[i].dtype);
    }
    return gi;
  }
  std::vector<TensorMeta> inputs;

 private:
  std::shared_ptr<Primitive> prim_;
  std::string name_;
};

[[noreturn]] void fail_no_cuda(const char* op) { fail("[", op, "] has no CUDA implementation in this build"); }

}  // namespace

std::vector<Tensor> Primitive::forward(const std::vector<Tensor>& inputs) {
  return forward_on(device_of(inputs), inputs);
}

std::vector<Tensor> Primitive::forward_on(Device device, const std::vector<Tensor>& inputs) {
  return device.is_cuda() ? forward_cuda(inputs) : forward_cpu(inputs);
}

Device Primitive::device_of(const std::vector<Tensor>& inputs) const { return common_device(name(), inputs); }

std::vector<Tensor> Primitive::forward_cuda(const std::vector<Tensor>&) { fail_no_cuda(name()); }

std::vector<Tensor> Primitive::backward(const BackwardContext&) {
  fail("[", name(), "] is not differentiable");
}

void set_distributed_dispatch(DistributedDispatch fn) { dist_dispatch() = std::move(fn); }
void set_distributed_zeros(DistributedZeros fn) { dist_zeros() = std::move(fn); }

namespace {
DistSpecEqual& spec_equal() {
  static DistSpecEqual fn;
  return fn;
}
}  // namespace

void set_dist_spec_equal(DistSpecEqual fn) { spec_equal() = std::move(fn); }

bool same_layout(const Tensor& a, const Tensor& b) {
  if (a.is_distributed() != b.is_distributed()) return false;
  if (!a.is_distributed()) return true;
  if (a.dist_spec() == b.dist_spec()) return true;
  return spec_equal() && spec_equal()(*a.dist_spec(), *b.dist_spec());
}

std::vector<Tensor> apply(std::shared_ptr<Primitive> p, const std::vector<Tensor>& inputs) {
  bool any_dist = false, any_grad = false;
  for (const Tensor& t : inputs) {
    if (!t.defined()) continue;
    any_dist = any_dist || t.is_distributed();
    any_grad = any_grad || t.requires_grad();
  }
  // logging.trace: every op as a slice with its input shapes (global shapes when distributed).
  trace::Scope scope;
  if (trace::enabled()) {
    scope.begin("op", p->name());
    scope.arg("shapes", trace::shapes_of(inputs));
    if (any_dist) scope.arg("distributed", int64_t(1));
  }
  std::vector<Tensor> outs;
  if (any_dist && !p->composite()) {
    QUILT_CHECK(static_cast<bool>(dist_dispatch()), "[", p->name(),
                "] got a distributed tensor but no distributed dispatcher is installed");
    outs = dist_dispatch()(*p, inputs);
  } else {
    outs = p->forward(inputs);
  }
  if (!(any_grad && grad_enabled())) return outs;

  auto node = std::make_shared<PrimitiveNode>(p);
  node->next.reserve(inputs.size());
  for (const Tensor& t : inputs) {
    node->next.push_back(gradient_edge(t));
    node->inputs.push_back(meta_of(t));
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    for (const Tensor& t : inputs)
      if (t.defined() && outs[i].is_same(t)) outs[i] = outs[i].detach();  // never re-home an input
  }
  p->save(inputs, outs);
  node->outputs.resize(outs.size());
  node->output_hooks.resize(outs.size());
  node->retain_output.resize(outs.size());
  node->retained.resize(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    node->outputs[i] = meta_of(outs[i]);
    if (outs[i].defined() && p->differentiable_output(i, outs[i])) outs[i].set_autograd(node, uint32_t(i));
  }
  return outs;
}

Tensor apply1(std::shared_ptr<Primitive> p, const std::vector<Tensor>& inputs) {
  auto outs = apply(std::move(p), inputs);
  return outs.at(0);
}

void require_cpu(const char* op, const std::vector<Tensor>& inputs) {
  for (const Tensor& t : inputs)
    if (t.defined() && t.device().is_cuda()) fail_no_cuda(op);
}

Device common_device(const char* op, const std::vector<Tensor>& inputs) {
  std::optional<Device> d;
  for (const Tensor& t : inputs) {
    if (!t.defined()) continue;
    if (!d) d = t.device();
    else QUILT_CHECK(*d == t.device(), "[", op, "] inputs on different devices: ", d->str(), " and ", t.device().str());
  }
  return d.value_or(Device::cpu());
}

}  // namespace quilt
