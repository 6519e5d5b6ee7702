// DDP as replicate(module, mesh): parameters replicated over the data-parallel mesh, gradients
// averaged over it in buckets, each bucket's all-reduce started (asynchronously) from the
// post-accumulate-grad hooks as soon as its last gradient is ready, so communication overlaps
// the rest of backward. The same step seam as fully_shard (set_requires_gradient_sync,
// finish_backward), so a trainer drives either one way.
//
//   auto ddp = replicate(*model, meshes["dp"], {.bucket_bytes = 1 << 20});
//   for (micro ...) { ddp->set_requires_gradient_sync(micro == last); loss(micro).backward(); ddp->finish_backward(); }
//   optimizer.step();        // .grad holds the dp-average
#pragma once

#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/mesh.h"
#include "engine/nn/module.h"

namespace quilt {

struct DDPOptions {
  int64_t bucket_bytes = int64_t(1) << 20;  // gradients per all-reduce (in the reduce dtype)
  std::optional<DType> reduce_dtype;        // none: the gradient's dtype
  bool broadcast_parameters = true;         // start from rank 0's values (catches divergent init)
};

class DistributedDataParallel {
 public:
  /// Hooks every parameter of `module` that requires grad. `comm` spans the data-parallel ranks.
  DistributedDataParallel(Module& module, std::shared_ptr<Communicator> comm, DDPOptions opts = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Whether the next backward reduces gradients (false for all but the last micro-batch of a
  /// gradient-accumulation step: they only accumulate locally).
  void set_sync(bool sync) { sync_ = sync; }
  /// Waits for every bucket (launching any whose parameters got no gradient, with zeros for
  /// them) and writes the averaged gradients back to .grad.
  void finish();
  /// Number of buckets (for tests and logs).
  size_t num_buckets() const { return buckets_.size(); }
  Communicator& comm() { return *comm_; }

 private:
  struct Bucket {
    std::vector<Tensor> params;
    std::vector<int64_t> offsets;  // element offset of each parameter's gradient in `flat`
    Tensor flat;
    size_t ready = 0;
    bool launched = false;
    Work work;
  };
  void on_grad_ready(size_t bucket);
  void launch(Bucket& b);

  std::shared_ptr<Communicator> comm_;
  DDPOptions opts_;
  std::vector<Bucket> buckets_;
  bool sync_ = true;
  std::shared_ptr<bool> alive_;  // hooks outlive this object in the parameters; they check it
};

/// DDP on a data-parallel mesh (1-D, or several axes flattened into one).
class ReplicateModule {
 public:
  ReplicateModule(Module& module, const DeviceMesh& mesh, DDPOptions opts);
  /// Whether the next backward all-reduces gradients (false: they accumulate locally).
  void set_requires_gradient_sync(bool sync);
  /// After each backward: when syncing, waits for the buckets and writes the averages to .grad.
  void finish_backward();
  const DeviceMesh& mesh() const { return mesh_; }
  DistributedDataParallel& ddp() { return ddp_; }

 private:
  DeviceMesh mesh_;
  DistributedDataParallel ddp_;
  bool sync_ = true;
};

/// Replicates `module` over `mesh` (every axis of it: a 2-D mesh is flattened). Collective.
std::shared_ptr<ReplicateModule> replicate(Module& module, const DeviceMesh& mesh, DDPOptions opts = {});

}  // namespace quilt
