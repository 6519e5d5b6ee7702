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

#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "engine/nn/module.h"

namespace quilt {

class FullyShardedDataParallel {
 public:
  /// Shards every parameter of `module` over `mesh`: a 1-D ("dp_shard") or 2-D
  /// ("dp_replicate", "dp_shard") mesh. Parameter values must already agree on every rank.
  FullyShardedDataParallel(Module& module, DeviceMesh mesh);
  /// This rank's slice of a batch (dim 0) as the global batch, distributed over the dp axes.
  Tensor shard_batch(const Tensor& local) const;
  const DeviceMesh& mesh() const { return mesh_; }
  const Placements& param_placements() const { return param_placements_; }

 private:
  DeviceMesh mesh_;
  Placements param_placements_, batch_placements_;
};

}  // namespace quilt
