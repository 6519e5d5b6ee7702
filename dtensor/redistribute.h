// Redistribute planning and execution on local shards. One mesh axis changes per step; each
// (source, target) pair of placements on an axis maps to one collective or a local op:
//
//   S(d) -> R      all_gather_v along d          P -> R      all_reduce (sum|avg|max|min)
//   P -> S(d)      reduce_scatter_v along d      R -> S(d)   local slice (a copy)
//   S(i) -> S(j)   all_to_all_single with splits  S(d) -> P(sum)  local: the shard in zeros
//   R -> P(sum)    coordinate 0 keeps the value, the others hold zeros (exact, no division)
//   R -> P(avg|max|min)  every coordinate keeps the value
//
// A step on axis a that cuts or joins dim d is valid only while no later axis also shards d
// (a dim sharded over several axes is cut in mesh-axis order). The planner searches the
// orders of single-axis steps (Dijkstra over placement states, costed by the bytes each
// collective moves) and caches the cheapest plan per (mesh shape, source, target).
//
//   const RedistributePlan& p = plan_redistribute({2, 2}, {Shard(0), Shard(0)}, {Replicate(), Shard(0)});
//   p.str();   // "axis 1: S(0) -> R; axis 0: S(0) -> R; axis 1: R -> S(0)"
//
// The differentiable redistribute() of distributed tensors is in dtensor/dtensor.h.
#pragma once

#include <string>
#include <vector>

#include "dtensor/dist_spec.h"

namespace quilt {

/// One step: axis `axis` goes from `from` to `to`.
struct RedistributeStep {
  int64_t axis = 0;
  Placement from, to;
};

/// The steps from one placement vector to another and their cost (bytes moved per rank, as a
/// multiple of the global tensor's bytes).
struct RedistributePlan {
  std::vector<RedistributeStep> steps;
  double cost = 0;
  /// "axis 1: S(0) -> R; axis 0: S(0) -> R" ("no-op" when empty).
  std::string str() const;
};

/// The cheapest plan from `src` to `dst` on a mesh of `mesh_shape` (cached; thread-safe). Shard
/// dims must already be normalised. Throws naming both placements when `dst` mixes Partial
/// reductions that do not combine.
const RedistributePlan& plan_redistribute(const Shape& mesh_shape, const Placements& src, const Placements& dst);
/// Number of plans in the cache (for tests).
size_t redistribute_plan_cache_size();

/// Runs the plan from `src` to `dst` on this rank's shard `local` (of layout `src`) and returns
/// this rank's shard of the `dst` layout (contiguous, never aliasing `local`). Collective over
/// the mesh axes whose placement changes; no autograd.
Tensor redistribute_local(const Tensor& local, const DistSpec& src, const Placements& dst);

}  // namespace quilt
