// FSDP2: fully_shard(module, mesh, policy) makes `module` one unit whose parameters live
// sharded over the mesh's shard axis (on dim 0, or on dim 1 for a parameter with fewer rows
// than ranks: FSDPPolicy::shard_dim), all in one flat buffer per rank (each parameter's shard
// is a view of it, uneven sizes padded). A unit gathers its parameters with
// ONE all-gather before its forward (issued ahead by the unit before it: prefetch), frees them
// after forward when resharding, gathers again before its backward (prefetched by the unit
// after it) and reduce-scatters its gradients with ONE asynchronous reduce-scatter as soon as
// its backward ends, which overlaps the backward of the units before it. Apply it to each block
// first, then to the root, as torchtitan does:
//
//   for (auto& [name, block] : model->model->layers->named_children()) fully_shard(*block, mesh["dp_shard_cp"], policy);
//   auto root = fully_shard(*model, mesh["dp_shard_cp"], policy);
//   Tensor loss = loss_fn((*model)(tokens, positions), targets);   // batch: this rank's plain tensors
//   loss.backward();
//   root->finish_backward();              // waits for the reduce-scatters; sharded .grad set
//   optimizer.step();                     // over model->parameters(): the sharded leaves
//
// Compute runs on plain tensors over the data-parallel ranks (each rank its own batch); a
// parameter that is already a DTensor on a tensor-parallel mesh stays one when gathered, and
// its sharded form lives on a mesh of the TP axes followed by the FSDP axes. A 2-D mesh
// (dp_replicate, dp_shard) gives HSDP: sharded over the last axis, replicated over the first,
// gradients all-reduced over it after the reduce-scatter. Gradients are averaged over all of
// the mesh's ranks.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "dtensor/mesh.h"
#include "engine/nn/module.h"

namespace quilt {

/// How a unit holds, casts and reduces its parameters.
struct FSDPPolicy {
  /// Dtype parameters are gathered and computed in (cast once per gather); none: the master's.
  std::optional<DType> param_dtype;
  /// Dtype gradients are reduce-scattered in; none: the compute dtype (param_dtype's).
  std::optional<DType> reduce_dtype;
  /// Floating outputs of the unit are cast to it; none: left as computed.
  std::optional<DType> output_dtype;
  /// Floating inputs of the unit are cast to param_dtype before its forward.
  bool cast_forward_inputs = true;
  /// true: free the gathered parameters after forward and gather again for backward; false:
  /// keep them to backward; N (an int dividing the shard axis): keep them sharded over groups
  /// of N ranks, so backward gathers within the smaller group.
  std::variant<bool, int64_t> reshard_after_forward = true;
  /// Dotted-name suffixes of modules kept in f32 ("FP32 islands"): each becomes its own unit
  /// with param and reduce dtype f32, its outputs cast to param_dtype.
  std::vector<std::string> fp32_modules;
  /// Dotted names (under the unit's module) of parameters another parallelism owns: left as
  /// they are, not sharded, gathered or reduced here.
  std::vector<std::string> ignored_params;
  /// Gradients are summed over the mesh and divided by this instead of by its size (none).
  /// Expert parallelism needs it: an expert's gradient already sums the tokens of its whole
  /// ep group, so its unit over ep_shard divides by every data-parallel rank (dp * cp).
  std::optional<double> gradient_divide_factor;
  /// The dim each parameter is sharded on over the shard axis (PyTorch's shard_placement_fn),
  /// given its dotted name and the parameter as it is before sharding (a DTensor when already
  /// distributed); a negative dim counts from the end. Empty, or none returned: dim 0, except
  /// dim 1 when the parameter's (TP-local) shape has fewer dim-0 rows than the shard axis has
  /// ranks and a dim 1 of at least that many — MoE experts (E_local, I, H) with fewer experts
  /// than ranks, which dim 0 would leave on some ranks only. Every rank must answer the same.
  ///
  ///   policy.shard_dim = [](const std::string& name, const Tensor&) -> std::optional<int64_t> {
  ///     if (name.ends_with("experts.w1")) return 1;
  ///     return std::nullopt;
  ///   };
  std::function<std::optional<int64_t>(const std::string& param_name, const Tensor& param)> shard_dim;
};

/// What a unit did, for tests and logs (counters since creation).
struct FSDPUnitStats {
  int64_t all_gathers = 0;      // forward and backward gathers issued
  int64_t reduce_scatters = 0;  // gradient reduce-scatters issued
  double wait_seconds = 0;      // time spent waiting for this unit's gathers
  std::vector<uint64_t> all_gather_seqs;  // sequence numbers of its gathers on their communicator
};

namespace detail {
class FSDPUnit;
}

/// Handle of a fully_shard'ed module (the unit and the units nested in it).
class FSDPModule {
 public:
  explicit FSDPModule(std::shared_ptr<detail::FSDPUnit> unit) : unit_(std::move(unit)) {}
  /// Whether the next backward reduce-scatters gradients (false: they accumulate unsharded
  /// until a backward with true, which reduces all of them at once). Applies to nested units.
  void set_requires_gradient_sync(bool sync);
  /// Waits for every pending reduce-scatter (and HSDP all-reduce) of this unit and the units
  /// nested in it, reduces units whose gradients never all arrived, and accumulates the
  /// averaged shards into the sharded parameters' .grad. Call after each backward.
  void finish_backward();
  /// Gathers the parameters now (e.g. before an evaluation without hooks), or frees them.
  void unshard();
  void reshard();
  /// This unit's and its nested units' stats, in forward order (this unit first).
  std::vector<FSDPUnitStats> stats() const;
  /// Total time spent waiting for all-gathers by this unit and nested units.
  double all_gather_wait_seconds() const;
  /// Number of units (this one and those nested).
  size_t num_units() const;
  /// Names of the parameters this unit holds (not those of nested units), in flat-buffer order.
  std::vector<std::string> param_names() const;
  /// The dtype this unit gathers in.
  DType param_dtype() const;
  const std::shared_ptr<detail::FSDPUnit>& unit() const { return unit_; }

 private:
  std::shared_ptr<detail::FSDPUnit> unit_;
};

/// Makes `module` an FSDP unit over `mesh` (1-D: shard axis; 2-D: replicate, shard). Units made
/// earlier on descendants are nested in it (in registration order, which is their forward
/// order), and fp32 modules become units of their own first. Parameter values must already
/// agree on every rank. Collective over the mesh.
std::shared_ptr<FSDPModule> fully_shard(Module& module, const DeviceMesh& mesh, const FSDPPolicy& policy = {});

}  // namespace quilt
