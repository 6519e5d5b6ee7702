// DDP: replicated parameters whose gradients are averaged over a data-parallel communicator
// in buckets, each bucket's all-reduce started (asynchronously) from the post-accumulate-grad
// hooks as soon as its last gradient is ready, so communication overlaps the rest of backward.
//
//   DistributedDataParallel ddp(*model, comm, {.bucket_bytes = 1 << 20});
//   for (micro ...) { ddp.set_sync(micro == last); model->loss(x, y).backward(); }
//   ddp.finish();            // waits for the buckets; .grad now holds the dp-average
//   optimizer.step();
#pragma once

#include <memory>
#include <vector>

#include "collectives/communicator.h"
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

}  // namespace quilt
