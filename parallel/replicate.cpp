// DDP: see replicate.h. Buckets follow the reverse of registration order, which is roughly the order
// backward produces gradients, so the first bucket fills (and starts reducing) earliest.
#include "parallel/replicate.h"

#include "engine/autograd.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"

namespace quilt {

DistributedDataParallel::DistributedDataParallel(Module& module, std::shared_ptr<Communicator> comm, DDPOptions opts)
    : comm_(std::move(comm)), opts_(opts), alive_(std::make_shared<bool>(true)) {
  QUILT_CHECK(comm_ != nullptr, "[ddp] needs a communicator");
  std::vector<Tensor> params;
  for (const Tensor& p : module.parameters())
    if (p.requires_grad()) params.push_back(p);
  if (opts_.broadcast_parameters && comm_->size() > 1) {
    NoGradGuard ng;
    for (const Tensor& p : params) comm_->broadcast(p, 0);
  }
  // Reverse order; a new bucket when the current one would exceed bucket_bytes.
  Bucket cur;
  int64_t bytes = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const DType rdt = opts_.reduce_dtype.value_or(it->dtype());
    const int64_t b = it->numel() * int64_t(dtype_size(rdt));
    if (!cur.params.empty() && bytes + b > opts_.bucket_bytes) {
      buckets_.push_back(std::move(cur));
      cur = Bucket();
      bytes = 0;
    }
    cur.params.push_back(*it);
    bytes += b;
  }
  if (!cur.params.empty()) buckets_.push_back(std::move(cur));
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    int64_t n = 0;
    for (const Tensor& p : b.params) {
      b.offsets.push_back(n);
      n += p.numel();
    }
    b.offsets.push_back(n);
    b.flat = zeros({n}, {.dtype = opts_.reduce_dtype.value_or(b.params[0].dtype()), .device = b.params[0].device()});
    std::weak_ptr<bool> alive = alive_;
    for (Tensor& p : b.params) {
      p.register_post_accumulate_grad_hook([this, alive, bi](Tensor&) {
        if (alive.lock()) on_grad_ready(bi);
      });
    }
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  *alive_ = false;
  for (Bucket& b : buckets_)
    if (b.launched) b.work.wait();
}

void DistributedDataParallel::on_grad_ready(size_t bi) {
  if (!sync_) return;
  Bucket& b = buckets_[bi];
  if (++b.ready == b.params.size()) launch(b);
}

void DistributedDataParallel::launch(Bucket& b) {
  NoGradGuard ng;
  for (size_t i = 0; i < b.params.size(); ++i) {
    Tensor slot = b.flat.narrow(0, b.offsets[i], b.offsets[i + 1] - b.offsets[i]);
    Tensor g = b.params[i].grad();
    if (g.defined()) slot.copy_(g.reshape({-1}));
    else slot.zero_();
  }
  b.work = comm_->all_reduce(b.flat, ReduceOp::avg, /*async_op=*/true);
  b.launched = true;
}

void DistributedDataParallel::finish() {
  NoGradGuard ng;
  for (Bucket& b : buckets_)
    if (!b.launched) launch(b);  // some parameter got no gradient this step
  for (Bucket& b : buckets_) {
    b.work.wait();
    for (size_t i = 0; i < b.params.size(); ++i) {
      Tensor avg = b.flat.narrow(0, b.offsets[i], b.offsets[i + 1] - b.offsets[i]).view(b.params[i].shape());
      Tensor g = b.params[i].grad();
      if (g.defined()) g.copy_(avg);
      else b.params[i].set_grad(avg.to(b.params[i].dtype()).clone());
    }
    b.ready = 0;
    b.launched = false;
  }
}

namespace {
DeviceMesh one_axis(const DeviceMesh& mesh) {
  if (mesh.ndim() == 1) return mesh;
  return mesh.flatten(mesh.axis_names());
}
}  // namespace

ReplicateModule::ReplicateModule(Module& module, const DeviceMesh& mesh, DDPOptions opts)
    : mesh_(one_axis(mesh)), ddp_(module, mesh_.comm_ptr(0), opts) {}

void ReplicateModule::set_requires_gradient_sync(bool sync) {
  sync_ = sync;
  ddp_.set_sync(sync);
}

void ReplicateModule::finish_backward() {
  if (sync_) ddp_.finish();
}

std::shared_ptr<ReplicateModule> replicate(Module& module, const DeviceMesh& mesh, DDPOptions opts) {
  QUILT_CHECK(mesh.defined(), "[replicate] needs a mesh");
  return std::make_shared<ReplicateModule>(module, mesh, opts);
}

}  // namespace quilt
