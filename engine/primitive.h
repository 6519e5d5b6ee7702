// Primitive: one op of the engine. Its forward computes on plain (local) tensors, written once
// per device: forward_cpu and forward_cuda. Which one runs is decided in one place, forward(),
// from the device the inputs share (device_of); an op with no CUDA kernel does not override
// forward_cuda, and the base throws "[op] has no CUDA implementation in this build". An op whose
// forward is the same code on every device (a view, a copy, checkpoint, a collective) derives
// from AnyDevicePrimitive and writes forward_any instead. It saves what its backward needs via
// save(); its backward is written in ops, so gradients are themselves tensors of the same kind
// (distributed when the inputs were).
//
//   class Exp : public Primitive {                   // see engine/ops/unary.cpp
//     std::vector<Tensor> forward_cpu(const std::vector<Tensor>& in) override;   // kernels/cpu
//     std::vector<Tensor> forward_cuda(const std::vector<Tensor>& in) override;  // kernels/cuda
//   };
//   Tensor y = apply1(std::make_shared<Exp>(), {x});
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "engine/autograd.h"
#include "engine/tensor.h"

namespace quilt {

/// What backward gets: gradients of the outputs (zeros materialised), which inputs need one,
/// and the metadata of inputs and outputs as the caller saw them.
struct BackwardContext {
  std::vector<Tensor> grads;
  std::vector<bool> needs;
  std::vector<TensorMeta> inputs;
  std::vector<TensorMeta> outputs;
};

/// A primitive's attribute value: an int (dim, index), a float, a flag, a shape/dim list or a name.
using AttrValue = std::variant<int64_t, double, bool, Shape, std::string>;
/// Named attributes of a primitive — what sharding rules read ("dims", "shape", "keepdim", ...).
using Attrs = std::map<std::string, AttrValue>;

class Primitive {
 public:
  virtual ~Primitive() = default;
  /// The op's name as users see it ("matmul", "exp", ...).
  virtual const char* name() const = 0;
  /// Computes outputs from inputs (no graph recording; inputs are local tensors) on their
  /// device: forward_on(device_of(inputs), inputs). Not virtual: the one place a device is chosen.
  std::vector<Tensor> forward(const std::vector<Tensor>& inputs);
  /// Runs forward_cpu or forward_cuda as `device` says (forward() without the device lookup).
  std::vector<Tensor> forward_on(Device device, const std::vector<Tensor>& inputs);
  /// The device forward() runs on: the inputs' common device (throws naming the op when they
  /// differ). An op without tensor inputs overrides it to return its device attribute.
  virtual Device device_of(const std::vector<Tensor>& inputs) const;
  /// Computes outputs from CPU inputs (called by forward()).
  virtual std::vector<Tensor> forward_cpu(const std::vector<Tensor>& inputs) = 0;
  /// Computes outputs from CUDA inputs (called by forward()); by default throws
  /// "[name] has no CUDA implementation in this build".
  virtual std::vector<Tensor> forward_cuda(const std::vector<Tensor>& inputs);
  /// Keeps what backward needs (called only when the graph is recorded, with the caller's tensors).
  virtual void save(const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs) {}
  /// Gradients w.r.t. inputs; entries where !ctx.needs[i] may stay undefined.
  virtual std::vector<Tensor> backward(const BackwardContext& ctx);
  /// The op's attributes by name (dims, shapes, flags) for sharding rules and printing.
  virtual Attrs attrs() const { return {}; }
  /// True for outputs that can carry gradients (default: floating outputs).
  virtual bool differentiable_output(size_t i, const Tensor& out) const { return is_floating(out.dtype()); }
  /// True when forward is itself written in ops (checkpoint; an AnyDevicePrimitive): apply()
  /// then runs it on distributed inputs as they are, since the ops inside dispatch themselves.
  virtual bool composite() const { return false; }

 protected:
  /// Saved tensors are detached copies of the handles (no graph cycles).
  std::vector<Tensor> saved_;
};

/// A primitive whose forward is one piece of code for every device: views and copies (no kernel
/// of their own), ops written in other ops (composite(): checkpoint), collectives that take
/// tensors of any device. forward() still checks that the inputs share a device (device_of).
class AnyDevicePrimitive : public Primitive {
 public:
  /// Computes outputs from inputs on whichever device they are.
  virtual std::vector<Tensor> forward_any(const std::vector<Tensor>& inputs) = 0;
  std::vector<Tensor> forward_cpu(const std::vector<Tensor>& inputs) final { return forward_any(inputs); }
  std::vector<Tensor> forward_cuda(const std::vector<Tensor>& inputs) final { return forward_any(inputs); }
};

/// Runs `p` on `inputs`, records a graph node when any input requires grad, and routes
/// distributed inputs through the dispatcher that dtensor/ installs.
std::vector<Tensor> apply(std::shared_ptr<Primitive> p, const std::vector<Tensor>& inputs);
/// apply() for single-output primitives.
Tensor apply1(std::shared_ptr<Primitive> p, const std::vector<Tensor>& inputs);

/// The distributed dispatcher: given a primitive and inputs of which at least one is
/// distributed, returns its outputs (installed by dtensor/).
using DistributedDispatch =
    std::function<std::vector<Tensor>(Primitive& p, const std::vector<Tensor>& inputs)>;
void set_distributed_dispatch(DistributedDispatch fn);
/// Makes a zero tensor for a distributed metadata (gradients of unused distributed outputs).
using DistributedZeros = std::function<Tensor(const TensorMeta& meta)>;
void set_distributed_zeros(DistributedZeros fn);
/// Layout equality of two distributed specs (in-place ops on distributed tensors need equal layouts).
using DistSpecEqual = std::function<bool(const DistSpec& a, const DistSpec& b)>;
void set_dist_spec_equal(DistSpecEqual fn);
/// True when both tensors are plain, or both distributed with equal layouts.
bool same_layout(const Tensor& a, const Tensor& b);

/// Throws "[op] has no CUDA implementation in this build" if any input is on a CUDA device: for
/// functions that are not primitives (a primitive gets this from Primitive::forward_cuda).
void require_cpu(const char* op, const std::vector<Tensor>& inputs);
/// Throws naming `op` unless all inputs live on the same device.
Device common_device(const char* op, const std::vector<Tensor>& inputs);

}  // namespace quilt
