// Distributed tensors: a global tensor described by a device mesh and one placement per mesh
// axis. A distributed tensor is an ordinary Tensor carrying a DistSpec: shape() is the global
// shape, local() (or to_local) is this rank's shard, and every op of the engine accepts it
// (dtensor/dispatch.h routes it through the op's sharding rule). All functions here are
// differentiable; the gradient of a distributed leaf arrives in the leaf's own layout.
//
//   DeviceMesh mesh(world_ptr(), {2, 4}, {"dp", "tp"});
//   Tensor w = distribute_tensor(randn({16, 8}, RngKey(0, "w")), mesh, {Replicate(), Shard(0)});
//   Tensor y = relu(matmul(x, w));                 // sharding propagates, no gather needed
//   Tensor r = redistribute(y, {Replicate(), Replicate()});
//   Tensor full = full_tensor(y);                  // plain tensor, the same on every rank
#pragma once

#include <optional>

#include "dtensor/dist_spec.h"
#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "engine/tensor.h"

namespace quilt {

/// Distributes `full` (which every rank must hold with the same values) over `mesh`: each rank
/// keeps its shard (a copy) of Shard axes; Partial axes keep the value on coordinate 0 and
/// zeros elsewhere (sum), or the value everywhere (avg, max, min). A distributed `full` is
/// redistributed instead. The gradient w.r.t. `full` is the full gradient on every rank.
Tensor distribute_tensor(const Tensor& full, const DeviceMesh& mesh, const Placements& placements);

/// A distributed tensor whose shard on this rank is `local` (no copy). `shape` is the global
/// shape; when absent it is inferred from the local sizes along every Shard axis (a small
/// all-reduce per Shard axis), which is right for uneven shards too. Throws naming the rank when
/// `local` is not the shard the placements give this rank. The gradient w.r.t. `local` is the
/// matching shard of the gradient (Partial axes receive the Replicate gradient).
Tensor from_local(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                  const std::optional<Shape>& shape = std::nullopt);

/// This rank's shard as a plain tensor (sharing storage). The gradient flowing back is taken as
/// the shard of a distributed gradient placed by `grad_placements` (default: x's placements).
Tensor to_local(const Tensor& x, const std::optional<Placements>& grad_placements = std::nullopt);

/// A parameter as a computation on this rank's local tensors uses it: a plain one as it is, a
/// distributed one as its shard (to_local), whose gradient arrives as the shard of the
/// gradient on sharded axes and as a Partial(sum) on replicated axes — the local computation
/// saw only this rank's part of the work (e.g. its tensor-parallel heads), so the replicas'
/// gradients are parts of one sum, which the gradient's redistribution adds up.
Tensor local_view(const Tensor& param);
/// The global value as a plain tensor on every rank (all-gathers and all-reduces as needed).
Tensor full_tensor(const Tensor& x);

/// `x` with new placements on the same mesh (the same global value). Differentiable: the
/// gradient goes back to x's placements, except that Partial axes of x receive Replicate.
Tensor redistribute(const Tensor& x, const Placements& placements);

/// The mesh, placements and local shape of a distributed tensor (throw for plain tensors).
const DeviceMesh& mesh_of(const Tensor& x);
const Placements& placements_of(const Tensor& x);

/// True when `x` is distributed and placed exactly by `placements` (Shard dims may be negative).
bool has_placements(const Tensor& x, const Placements& placements);

}  // namespace quilt
