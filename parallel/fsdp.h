// FSDP2 / HSDP on the DTensor layer: every parameter becomes a distributed leaf sharded on
// dim 0 over the data-parallel shard axis (and replicated over dp_replicate for HSDP); the
// batch is sharded on dim 0 over all data-parallel axes. The dispatcher all-gathers a weight
// where an op needs it whole and reduce-scatters its gradient back into the shard layout, so
// each rank holds 1/dp_shard of the parameters, gradients and optimizer state.
//
//   DeviceMesh mesh(world_ptr(), {2, 2}, {"dp_replicate", "dp_shard"});
//   FullyShardedDataParallel fsdp(*model, mesh);
//   Tensor loss = model->loss(fsdp.shard_batch(x), fsdp.shard_batch(y));
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "engine/nn/module.h"

namespace quilt {

/// A model's tensor-parallel plan: the placement of a parameter (by dotted name) on the "tp" axis.
using TensorParallelPlan = std::function<Placement(const std::string& param_name)>;

class FullyShardedDataParallel {
 public:
  /// Distributes every parameter of `module` over `mesh`, whose axes are named "dp_replicate"
  /// (parameters replicated), "dp_shard" (parameters sharded on dim 0) and "tp" (placed by
  /// `tp_plan`); the batch is sharded on dim 0 over the dp axes and replicated over tp.
  /// Parameter values must already agree on every rank.
  FullyShardedDataParallel(Module& module, DeviceMesh mesh, TensorParallelPlan tp_plan = nullptr);
  /// Makes `unit` (a block) one FSDP unit that gathers its parameters once per forward and keeps
  /// them for backward (reshard_after_forward: false): one all-gather per unit instead of one per
  /// use in forward and another in backward, at the cost of holding the unit's full weights from
  /// its forward to its backward. Without this every op gathers the weight it needs and drops it.
  void keep_gathered_through_backward(Module& unit);
  /// Whether the next backward synchronises gradients. With false (the micro-batches before the
  /// last of a gradient-accumulation step, defer_fsdp_grad_sync) each parameter's unreduced
  /// gradient is kept locally and the reduce-scatter runs once, in the backward with true.
  void set_requires_gradient_sync(bool sync) { state_->sync = sync; }
  /// This rank's slice of a batch (dim 0) as the global batch, distributed over the dp axes.
  Tensor shard_batch(const Tensor& local) const;
  /// Sequence parallelism: the residual stream (batch, seq, hidden) sharded on the sequence dim
  /// over tp (and the batch over dp). The dispatcher then all-gathers before each tp-sharded
  /// matmul and reduce-scatters the partial outputs back into this layout, as Megatron's SP does.
  Tensor sequence_parallel(const Tensor& hidden) const;
  const DeviceMesh& mesh() const { return mesh_; }

 private:
  struct State {
    bool sync = true;
  };
  DeviceMesh mesh_;
  Placements batch_placements_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace quilt
