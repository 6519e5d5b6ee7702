// FSDP2 / HSDP: see fsdp.h.
#include "parallel/fsdp.h"

#include "dtensor/dist_spec.h"
#include "dtensor/dtensor.h"
#include "engine/autograd.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"

namespace quilt {

FullyShardedDataParallel::FullyShardedDataParallel(Module& module, DeviceMesh mesh, TensorParallelPlan tp_plan)
    : mesh_(std::move(mesh)) {
  std::vector<std::string> axes;
  for (int64_t a = 0; a < mesh_.ndim(); ++a) axes.push_back(mesh_.axis_names()[size_t(a)]);
  for (const std::string& a : axes) {
    QUILT_CHECK(a == "dp_replicate" || a == "dp_shard" || a == "tp", "[fsdp] mesh axis '", a,
                "' is not one of dp_replicate, dp_shard, tp (mesh ", mesh_.str(), ")");
    QUILT_CHECK(a != "tp" || tp_plan, "[fsdp] the mesh has a tp axis but the model gave no tensor-parallel plan");
    batch_placements_.push_back(a == "tp" ? Placement(Replicate()) : Placement(Shard(0)));
  }
  for (auto& [name, p] : module.named_parameters()) {
    Placements pl;
    for (const std::string& a : axes)
      pl.push_back(a == "dp_replicate" ? Placement(Replicate()) : a == "dp_shard" ? Placement(Shard(0)) : tp_plan(name));
    Tensor sharded;
    {
      NoGradGuard ng;
      sharded = distribute_tensor(p.detach(), mesh_, pl).detach();
    }
    sharded.set_requires_grad(p.requires_grad());
    if (p.requires_grad()) {
      // Runs before the dispatcher's hook that reduces the gradient into the shard layout: while
      // sync is off it banks the unreduced gradient and lets a zero through (no communication);
      // the synchronising backward adds the bank, so one reduce-scatter covers every micro-batch.
      auto bank = std::make_shared<Tensor>();
      std::weak_ptr<State> state = state_;
      sharded.register_hook([bank, state](const Tensor& g) -> Tensor {
        auto st = state.lock();
        if (!st || !g.defined()) return {};
        if (!st->sync) {
          *bank = bank->defined() ? add(*bank, g.detach()) : g.detach();
          return zeros_like(g);
        }
        if (!bank->defined()) return {};
        Tensor total = add(*bank, g);
        *bank = Tensor();
        return total;
      });
    }
    module.replace_parameter(name, sharded);
  }
}

void FullyShardedDataParallel::keep_gathered_through_backward(Module& unit) {
  // Replicated over the dp axes, as placed on tp; redistribute is differentiable, so the
  // gathered weights' gradients reduce-scatter back into the shards.
  auto leaves = std::make_shared<NamedTensors>();
  const std::vector<std::string> axes = mesh_.axis_names();
  unit.register_forward_pre_hook([leaves, axes](Module& m, std::vector<Tensor>&) {
    *leaves = m.named_parameters();
    for (auto& [name, p] : *leaves) {
      if (!p.is_distributed()) continue;
      Placements pl = p.dist_spec()->placements;
      for (size_t a = 0; a < axes.size(); ++a)
        if (axes[a] != "tp") pl[a] = Replicate();
      m.replace_parameter(name, redistribute(p, pl));
    }
  });
  unit.register_forward_hook([leaves](Module& m, const std::vector<Tensor>&, std::vector<Tensor>&) {
    for (auto& [name, p] : *leaves) m.replace_parameter(name, p);
    leaves->clear();
  });
}

Tensor FullyShardedDataParallel::shard_batch(const Tensor& local) const {
  Shape global = local.shape();
  for (int64_t a = 0; a < mesh_.ndim(); ++a)  // every dp rank holds an equal slice of the global batch
    if (mesh_.axis_names()[size_t(a)] != "tp") global[0] *= mesh_.size(a);
  return from_local(local, mesh_, batch_placements_, global);
}

Tensor FullyShardedDataParallel::sequence_parallel(const Tensor& hidden) const {
  Placements pl = batch_placements_;
  for (int64_t a = 0; a < mesh_.ndim(); ++a)
    if (mesh_.axis_names()[size_t(a)] == "tp") pl[size_t(a)] = Shard(1);
  return redistribute(hidden, pl);
}

}  // namespace quilt
