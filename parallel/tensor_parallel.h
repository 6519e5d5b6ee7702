// Tensor parallelism by plan, as torchtitan's parallelize_module: a plan maps module names
// (dotted, "*" standing for one name component such as the layer index) to styles, and
// apply_tp() lays each named module's parameters out over the 1-D tp mesh and installs forward
// hooks that lay its inputs and outputs out as the style says.
//
//   TensorParallelPlan plan;
//   plan.add("model.layers.*.mlp.up_proj", ColwiseParallel{})
//       .add("model.layers.*.mlp.down_proj", RowwiseParallel{})
//       .add("lm_head", ColwiseParallel{.output_layouts = Shard(-1), .use_local_output = false});
//   apply_tp(*model, meshes["tp"], plan);
//
// Between modules, activations are plain local tensors (each data-parallel rank computes on
// its own batch); inside a tensor-parallel region they are distributed tensors on the tp mesh
// as the styles say. An input "layout" is how a plain input lies over tp (Replicate: every
// tp rank holds all of it; Shard(d): each holds its piece of dim d), a "desired" layout what
// the module computes on. A plain input sharded on a dim is taken as an even split, except
// where the module knows the global size (a Linear's in_features); from_local refuses a
// wrong guess naming the rank. Parameters become distributed tensors in their modules' slots,
// so later wrappers (FSDP) may swap the slots again; hooks never keep a parameter handle.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "engine/nn/module.h"
#include "parallel/module_names.h"

namespace quilt {

/// Column-parallel Linear (weight (out, in) Shard(0), bias Shard(0)): a replicated input gives
/// an output sharded on its last dim. On an Embedding the columns are the embedding dim
/// (weight Shard(1)).
struct ColwiseParallel {
  std::optional<Placement> input_layouts = std::nullopt;  // a plain input's layout; default Replicate
  Placement output_layouts = Shard(-1);    // the output is redistributed to this
  bool use_local_output = true;            // hand the output on as this rank's plain shard
};

/// Row-parallel Linear (weight Shard(1), bias Replicate): an input sharded on its last dim
/// gives Partial(sum) outputs, reduced to `output_layouts` (Replicate: all-reduce; Shard(1):
/// reduce-scatter onto the sequence, for sequence parallelism). On an Embedding the rows are
/// the vocabulary (weight Shard(0), vocab-parallel): a replicated index input, partial outputs.
struct RowwiseParallel {
  std::optional<Placement> input_layouts = std::nullopt;  // default Shard(-1) (Linear), Replicate (Embedding)
  Placement output_layouts = Replicate();
  bool use_local_output = true;
};

/// Sequence-parallel module (norms): parameters replicated, input and output sharded on the
/// sequence dim; the output stays distributed for the next module's PrepareModuleInput.
struct SequenceParallel {
  int64_t sequence_dim = 1;
  bool use_local_output = false;
};

/// Redistributes a module's inputs before it runs. Input i with a layout is taken as laid out
/// by input_layouts[i] (when plain) and redistributed to desired_input_layouts[i]; inputs
/// without one (nullopt, or past the end) are left alone.
struct PrepareModuleInput {
  std::vector<std::optional<Placement>> input_layouts = {};
  std::vector<std::optional<Placement>> desired_input_layouts = {};
  bool use_local_output = false;
};

/// Redistributes a module's outputs after it runs, as PrepareModuleInput does its inputs.
struct PrepareModuleOutput {
  std::vector<std::optional<Placement>> output_layouts = {};
  std::vector<std::optional<Placement>> desired_output_layouts = {};
  bool use_local_output = true;
};

/// One module's tensor-parallel style.
using ParallelStyle =
    std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput>;

/// Module-name patterns and their styles, applied in order (a module may take several, e.g.
/// SequenceParallel then PrepareModuleOutput). "" names the root module.
struct TensorParallelPlan {
  std::vector<std::pair<std::string, ParallelStyle>> entries;

  /// Appends `pattern` -> `style`.
  TensorParallelPlan& add(std::string pattern, ParallelStyle style) {
    entries.emplace_back(std::move(pattern), std::move(style));
    return *this;
  }
  /// Drops every entry of exactly `pattern`; false when there was none.
  bool erase(const std::string& pattern);
  /// Whether some entry has exactly `pattern`.
  bool contains(const std::string& pattern) const;
};

/// "ColwiseParallel", "RowwiseParallel", ... (for messages).
const char* style_name(const ParallelStyle& style);

/// Applies `plan` to `root` over the 1-D `tp_mesh`: distributes the parameters of every
/// matched module as its style says (values must agree on every tp rank) and installs its
/// input/output hooks. Throws naming the pattern when it matches no module, and the module
/// when a style does not fit its type (Colwise/Rowwise: Linear or Embedding) or its
/// parameters are already distributed.
void apply_tp(Module& root, const DeviceMesh& tp_mesh, const TensorParallelPlan& plan);

/// Puts a distributed copy of parameter `local_name` of `m` (`module_name` in messages) into
/// its slot, placed by `placement` on the 1-D `mesh`; one built under DeferredInitGuard stays
/// without storage. Refuses a parameter that is already distributed, naming it and `op`.
void distribute_parameter(Module& m, const std::string& module_name, const std::string& local_name,
                          const DeviceMesh& mesh, const Placement& placement, const char* op = "apply_tp");

}  // namespace quilt
