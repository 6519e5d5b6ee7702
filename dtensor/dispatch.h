// The distributed dispatcher that dtensor/ installs into the engine (set_distributed_dispatch):
// every op with a distributed input comes here. It looks up the op's sharding rule by name,
// picks the cheapest n-D strategy (no redistribution preferred), redistributes the inputs,
// runs the op on the local shards and wraps the outputs. An op without a rule runs on
// replicated inputs and a warning naming the op and its placements is printed once.
//
// Installed on first use of dtensor/ (building a DeviceMesh); nothing to call by hand.
//
//   Tensor y = relu(x_sharded);                  // dispatched: stays Shard(0), no communication
//   dtensor_fallback_warnings();                 // {"cumsum (S(0))", ...}: ops that ran replicated
#pragma once

#include <string>
#include <vector>

#include "dtensor/dist_spec.h"
#include "engine/primitive.h"

namespace quilt {

/// The "op (placements)" keys of ops that had no sharding rule and ran replicated (each warned once).
std::vector<std::string> dtensor_fallback_warnings();
/// Turns the one-time fallback warning on stderr off or on (tests that exercise it).
void set_dtensor_fallback_warnings_printed(bool on);

namespace detail {

/// Installs the dispatcher, the distributed zeros factory and the layout comparison (once).
void ensure_dtensor_dispatch();

/// A primitive of dtensor/ itself (redistribute, from_local, ...): the dispatcher runs its
/// dist_forward directly instead of looking for a sharding rule.
class DistPrimitive : public Primitive {
 public:
  /// Computes the outputs from (possibly distributed) inputs; no graph recording.
  virtual std::vector<Tensor> dist_forward(const std::vector<Tensor>& inputs) = 0;
  std::vector<Tensor> forward(const std::vector<Tensor>& inputs) override { return dist_forward(inputs); }
};

/// Makes sure the gradient reaching leaf `leaf` has the leaf's own layout before it is
/// accumulated into .grad: a distributed leaf's is redistributed to its placements (so
/// optimizers update shard by shard), a plain leaf's becomes the plain full gradient.
/// Idempotent; the dispatcher calls it for every leaf input that requires grad.
void keep_grad_layout(const Tensor& leaf);

}  // namespace detail
}  // namespace quilt
