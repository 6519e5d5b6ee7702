// Sharding rules (internal to dtensor/): for each op, a small table of rows written for ONE mesh
// axis — {output placements..., input placements...} — that the dispatcher expands to n-D
// meshes (each axis picks a row independently) and costs by the bytes the needed
// redistributions move. Each row says why it is right in a comment next to it.
//
//   // "neg is linear: -(A1 + A2) = -A1 + -A2"
//   rows.push_back({{Partial()}, {Partial()}});
//
// A rule sees the op's name, attributes and the global shapes/dtypes of its inputs, and returns
// the output global shapes, the rows, and optionally a local computation (view-like ops, whose
// attributes are global shapes) and an n-D validity check. A rule that returns nullopt sends
// the op to the replicated fallback.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtensor/dist_spec.h"
#include "engine/primitive.h"

namespace quilt::rules {

/// What a rule knows of one input.
struct ArgInfo {
  bool defined = false;
  Shape shape;  // global
  DType dtype = DType::f32;
};

/// What a rule knows of one call.
struct OpInfo {
  std::string name;
  Attrs attrs;
  std::vector<ArgInfo> args;

  /// Attribute `key` as T; throws naming the op when it is missing or of another type.
  template <class T>
  const T& attr(const std::string& key) const {
    auto it = attrs.find(key);
    QUILT_CHECK(it != attrs.end() && std::holds_alternative<T>(it->second), "[dtensor] op '", name,
                "' has no attribute '", key, "' of the expected type (its sharding rule needs it)");
    return std::get<T>(it->second);
  }
  bool has_attr(const std::string& key) const { return attrs.count(key) != 0; }
};

/// One row of a single-axis table.
struct Row {
  std::vector<Placement> out;  // one per output
  std::vector<Placement> in;   // one per input (ignored for undefined inputs)
};

/// What the local computation may need to know.
struct LocalContext {
  const DeviceMesh& mesh;
  const std::vector<Shape>& out_shapes;           // global
  const std::vector<Placements>& out_placements;  // chosen n-D placements
  const std::vector<Placements>& in_placements;
  /// This rank's shard shape of output `i`.
  Shape local_out_shape(size_t i) const;
};

/// Computes the local outputs from the local (redistributed) inputs; runs under NoGradGuard.
using LocalFn = std::function<std::vector<Tensor>(Primitive& prim, const std::vector<Tensor>& locals,
                                                  const LocalContext& ctx)>;
/// Whether an n-D choice of placements is valid (on every coordinate of a mesh of `mesh_shape`).
using CheckFn = std::function<bool(const Shape& mesh_shape, const std::vector<Placements>& in,
                                   const std::vector<Placements>& out)>;

/// A rule's answer for one call.
struct Strategy {
  std::vector<Shape> out_shapes;  // global
  std::vector<Row> rows;          // the all-Replicate row is added when missing
  LocalFn local;                  // empty: the primitive's own forward on the shards
  CheckFn check;                  // empty: every combination of rows is valid
};

using Rule = std::function<std::optional<Strategy>(const OpInfo&)>;

/// Rules by op name.
class Registry {
 public:
  void add(const std::string& name, Rule rule) { rules_[name] = std::move(rule); }
  const Rule* find(const std::string& name) const {
    auto it = rules_.find(name);
    return it == rules_.end() ? nullptr : &it->second;
  }
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const auto& [k, v] : rules_) n.push_back(k);
    return n;
  }

 private:
  std::map<std::string, Rule> rules_;
};

/// The registry with every family's rules (built once).
const Registry& registry();

void register_pointwise_rules(Registry& r);
void register_matrix_rules(Registry& r);
void register_reduction_rules(Registry& r);
void register_view_rules(Registry& r);
void register_nn_rules(Registry& r);
void register_index_rules(Registry& r);
void register_moe_rules(Registry& r);
void register_attention_rules(Registry& r);

// ---- helpers shared by the rule files ----

/// All placements partial with `op` (one per output/input), for linear ops.
Row uniform_row(size_t n_out, size_t n_in, const Placement& p);
/// Output shape of broadcasting all defined inputs together.
Shape broadcast_all(const OpInfo& info);
/// Rows for pointwise ops over `out_shape`: Shard(d) of the output maps to the broadcast-aligned
/// dim of every input (Replicate where the input has no such dim or broadcasts it from size 1).
std::vector<Row> pointwise_shard_rows(const OpInfo& info, const Shape& out_shape, size_t n_out = 1);
/// Rows for an einsum-like op: `spec` such as "bmk,bkn->bmn" with one letter per dim of each
/// input; letters kept in the output shard it (inputs that broadcast them stay Replicate),
/// contracted letters give Partial(sum) outputs, and each input alone may be Partial
/// (linear in each argument).
std::vector<Row> einsum_rows(const std::string& spec, const OpInfo& info);
/// "sum", "avg", "max", "min" Partial placements for the ops that pass them through.
Placement partial(ReduceOp op);

}  // namespace quilt::rules
