// FSDP2 / HSDP: see fsdp.h.
#include "parallel/fsdp.h"

#include "dtensor/dtensor.h"
#include "engine/autograd.h"

namespace quilt {

FullyShardedDataParallel::FullyShardedDataParallel(Module& module, DeviceMesh mesh) : mesh_(std::move(mesh)) {
  QUILT_CHECK(mesh_.ndim() == 1 || mesh_.ndim() == 2, "[fsdp] needs a 1-D (dp_shard) or 2-D (dp_replicate, dp_shard) mesh, got ",
              mesh_.str());
  param_placements_ = mesh_.ndim() == 1 ? Placements{Shard(0)} : Placements{Replicate(), Shard(0)};
  batch_placements_ = mesh_.ndim() == 1 ? Placements{Shard(0)} : Placements{Shard(0), Shard(0)};
  for (auto& [name, p] : module.named_parameters()) {
    Tensor sharded;
    {
      NoGradGuard ng;
      sharded = distribute_tensor(p.detach(), mesh_, param_placements_).detach();
    }
    sharded.set_requires_grad(p.requires_grad());
    module.replace_parameter(name, sharded);
  }
}

Tensor FullyShardedDataParallel::shard_batch(const Tensor& local) const {
  Shape global = local.shape();
  global[0] *= mesh_.size();  // every dp rank holds an equal slice of the global batch
  return from_local(local, mesh_, batch_placements_, global);
}

}  // namespace quilt
