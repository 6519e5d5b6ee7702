// The data-parallel step of a parallelize plan: apply_fsdp (fully_shard per unit, then the
// root) or apply_ddp (replicate over the data-parallel mesh), and the handles a train step
// drives. A model's plan names its units; these functions only apply them in order.
//
//   DataParallelism dp;
//   dp.fsdp = apply_fsdp(*model, meshes["dp_shard_cp"], policy, {"model.layers.*"});
//   ... loss.backward(); dp.finish_backward(); optimizer.step();
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/fully_shard.h"
#include "parallel/replicate.h"

namespace quilt {

/// Whichever data parallelism a plan applied (both null: none).
struct DataParallelism {
  std::shared_ptr<FSDPModule> fsdp;
  std::shared_ptr<ReplicateModule> ddp;
  /// Whether the next backward synchronises gradients (false accumulates them locally).
  void set_requires_gradient_sync(bool sync) const;
  /// After each backward: waits for the gradient reductions it started.
  void finish_backward() const;
};

/// fully_shard every module of `root` matching one of `unit_patterns` ("model.layers.*"), in
/// model order, then `root` itself. Refuses a pattern that matches nothing, naming it.
std::shared_ptr<FSDPModule> apply_fsdp(Module& root, const DeviceMesh& mesh, const FSDPPolicy& policy,
                                       const std::vector<std::string>& unit_patterns);

/// replicate(root) over every axis of `mesh`.
std::shared_ptr<ReplicateModule> apply_ddp(Module& root, const DeviceMesh& mesh, DDPOptions opts = {});

}  // namespace quilt
