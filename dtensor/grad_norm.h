// Gradient norm and clipping over distributed parameters, on any number of meshes. Each
// parameter's gradient contributes its local sum of |g|^p, reduced over exactly the mesh axes
// its layout shards (never over Replicate axes, where every rank holds the same values, and
// over every Shard axis — the expert axis of MoE weights included); Partial gradients are
// reduced to Replicate first, since the norm of a sum is not the sum of the pieces' norms.
//
//   Tensor norm = dtensor::clip_grad_norm_(model->parameters(), 1.0);   // the same on every rank
//   dtensor::grad_norm(params, 2.0, &pp_comm);   // also over pipeline stages holding other params
#pragma once

#include <vector>

#include "collectives/communicator.h"
#include "engine/tensor.h"

namespace quilt::dtensor {

/// The norm_type-norm of the gradients of `params` (plain or distributed, on any meshes) taken
/// together, as a plain 0-d f64 tensor with the same value on every rank. norm_type is any
/// p > 0 or infinity. `across`, when given, holds ranks with disjoint parameter sets (pipeline
/// stages) whose contributions are added too. Collective over the meshes of the gradients.
Tensor grad_norm(const std::vector<Tensor>& params, double norm_type = 2.0, Communicator* across = nullptr);

/// grad_norm(), and when it exceeds max_norm, scales every gradient's local shard in place by
/// max_norm / (norm + 1e-6). A non-finite norm is returned as is and nothing is scaled.
Tensor clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type = 2.0,
                       Communicator* across = nullptr);

}  // namespace quilt::dtensor
