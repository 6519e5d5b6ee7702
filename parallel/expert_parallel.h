// Expert parallelism: the routed experts of every MoE block are split over the `ep` axis of
// the MoE mesh (pp, ep_shard, ep), E / ep experts per rank, and tokens travel to the ranks
// that hold their experts and back:
//   dispatch  all-to-all of the per-expert counts, all-to-all-v of the token rows (which the
//             block has sorted by expert, so each destination's rows are contiguous), then a
//             local reorder from source-rank-major to expert-major;
//   combine   the reverse: reorder back, all-to-all-v home.
// Both directions are differentiable (the gradient of an all-to-all-v is the reverse one), so
// the experts' weight gradients arrive summed over the tokens of every rank of the ep group.
//
//   apply_ep(*model, meshes["ep"], {"model.layers.*.mlp.experts"});   // before FSDP
//   fully_shard(*block.mlp->experts, meshes["ep_shard"], {.gradient_divide_factor = dp * cp});
#pragma once

#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/mesh.h"
#include "engine/nn/module.h"

namespace quilt {

/// Rows of x (sum(in_splits), ...) exchanged over `comm`: in_splits[j] rows go to rank j (in
/// order) and out_splits[j] rows come from rank j -> (sum(out_splits), ...). Differentiable:
/// the gradient takes the reverse exchange. Throws naming the splits when they do not fit.
Tensor all_to_all_rows(const Tensor& x, const std::shared_ptr<Communicator>& comm, const std::vector<int64_t>& in_splits,
                       const std::vector<int64_t>& out_splits);

/// Splits the experts modules under `root` named by `patterns` over the 1-D mesh `ep`. Such a
/// module holds grouped weights (E, ...) and is called as (rows sorted by expert (M, H),
/// counts (E) i64); its weights become distributed tensors Shard(0) on `ep` (deferred ones stay
/// without storage; weights the plan already cut over a mesh whose first axis is ep, Shard(0)
/// there, stay as they are) and it gets the dispatch / combine hooks, so its forward sees (rows of its
/// E / ep experts, their counts). Throws naming the module, its expert count and the ep size
/// when they do not divide, and a pattern that matches nothing.
void apply_ep(Module& root, const DeviceMesh& ep, const std::vector<std::string>& patterns);

/// Counters of the dispatches a rank did since start (tests, logs).
struct EPStats {
  int64_t dispatches = 0;
  int64_t tokens_sent = 0;     // rows this rank sent to other ranks (not counting its own)
  int64_t tokens_received = 0; // rows received from other ranks
};
EPStats ep_stats();

}  // namespace quilt
