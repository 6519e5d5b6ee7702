// The distributed dispatcher that dtensor/ installs into the engine (set_distributed_dispatch):
// every op with a distributed input comes here. It looks up the op's sharding rule by name,
// picks the cheapest n-D strategy (no redistribution preferred), redistributes the inputs,
// runs the op on the local shards and wraps the outputs. An op without a rule runs on
// replicated inputs and a warning naming the op and its placements is printed once. Before the
// rule table it asks the op's distributed handler, if one is registered (loss parallel
// cross entropy, dtensor/loss_parallel.h), which may compute the op its own way.
//
// Installed on first use of dtensor/ (building a DeviceMesh); nothing to call by hand.
//
//   Tensor y = relu(x_sharded);                  // dispatched: stays Shard(0), no communication
//   dtensor_fallback_warnings();                 // {"cumsum (S(0))", ...}: ops that ran replicated
#pragma once

#include <functional>
#include <optional>
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
class DistPrimitive : public AnyDevicePrimitive {
 public:
  /// Computes the outputs from (possibly distributed) inputs; no graph recording.
  virtual std::vector<Tensor> dist_forward(const std::vector<Tensor>& inputs) = 0;
  std::vector<Tensor> forward_any(const std::vector<Tensor>& inputs) final { return dist_forward(inputs); }
};

/// A distributed handler: computes op `p` on `inputs` (at least one distributed, all on one mesh)
/// its own way, or returns nullopt when their layouts are not its case (the rule table decides
/// then). Autograd still records `p`, so `p`'s backward op dispatches again and a handler for
/// that op's name keeps the backward on the same path.
using DistHandler =
    std::function<std::optional<std::vector<Tensor>>(Primitive& p, const std::vector<Tensor>& inputs)>;
/// Registers `handler` for op `name` (replacing an earlier one); the dispatcher consults it
/// before the rule table. The built-in handlers (loss parallel) are registered on first use.
void register_dist_handler(const std::string& name, DistHandler handler);

/// This rank's shard of `t` in layout `target` over `mesh`, where `cur` is t's layout (Replicate
/// everywhere for a plain t): t's own shard when they agree, else redistributed (no autograd).
Tensor local_shard_for(const Tensor& t, const Placements& cur, const Placements& target, const DeviceMesh& mesh);

/// Makes sure the gradient reaching leaf `leaf` has the leaf's own layout before it is
/// accumulated into .grad: a distributed leaf's is redistributed to its placements (so
/// optimizers update shard by shard), a plain leaf's becomes the plain full gradient.
/// Idempotent; the dispatcher calls it for every leaf input that requires grad.
void keep_grad_layout(const Tensor& leaf);

}  // namespace detail
}  // namespace quilt
