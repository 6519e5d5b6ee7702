// Placements: how a global tensor lies along one axis of a device mesh. Shard(d) cuts tensor
// dim d into torch.chunk-sized pieces (one per coordinate of the axis), Replicate keeps a full
// copy on every coordinate, Partial(op) keeps pieces whose reduction by `op` is the value.
// A distributed tensor has one placement per mesh axis (a Placements vector).
//
//   Placements pl = {Shard(0), Replicate()};          // 2-D mesh: rows over axis 0
//   Placements g = {Partial(), Shard(1)};             // Partial() is Partial(ReduceOp::sum)
//   str(pl) == "(S(0), R)"
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace quilt {

/// Tag for a shard of tensor dim `dim` (negative dims are wrapped against the tensor's rank).
struct Shard {
  int64_t dim = 0;
  explicit Shard(int64_t d) : dim(d) {}
};
/// Tag for a full copy on every coordinate of the axis.
struct Replicate {};
/// Tag for pieces that combine by `op` (sum, avg, max or min) into the value.
struct Partial {
  ReduceOp op = ReduceOp::sum;
  Partial() = default;
  explicit Partial(ReduceOp o) : op(o) {}
};

/// One mesh axis's placement: a Shard, Replicate or Partial (built implicitly from the tags).
class Placement {
 public:
  enum class Kind : uint8_t { replicate, shard, partial };

  Placement() = default;  // Replicate
  Placement(Shard s) : kind_(Kind::shard), dim_(s.dim) {}              // NOLINT: implicit on purpose
  Placement(Replicate) {}                                               // NOLINT
  Placement(Partial p) : kind_(Kind::partial), reduce_(p.op) {}         // NOLINT

  Kind kind() const { return kind_; }
  bool is_replicate() const { return kind_ == Kind::replicate; }
  bool is_shard() const { return kind_ == Kind::shard; }
  /// True for Shard(d) of exactly dim `d`.
  bool is_shard(int64_t d) const { return kind_ == Kind::shard && dim_ == d; }
  bool is_partial() const { return kind_ == Kind::partial; }
  /// True for Partial(op) of exactly `op`.
  bool is_partial(ReduceOp op) const { return kind_ == Kind::partial && reduce_ == op; }
  /// The sharded tensor dim (meaningful for Shard only).
  int64_t dim() const { return dim_; }
  /// The reduction of a Partial (meaningful for Partial only).
  ReduceOp reduce_op() const { return reduce_; }
  /// "S(0)", "R", "P(sum)".
  std::string str() const;

  friend bool operator==(const Placement& a, const Placement& b) {
    if (a.kind_ != b.kind_) return false;
    if (a.kind_ == Kind::shard) return a.dim_ == b.dim_;
    if (a.kind_ == Kind::partial) return a.reduce_ == b.reduce_;
    return true;
  }
  /// A total order (for map keys): replicate < shard(by dim) < partial(by op).
  friend bool operator<(const Placement& a, const Placement& b) {
    if (a.kind_ != b.kind_) return a.kind_ < b.kind_;
    if (a.kind_ == Kind::shard) return a.dim_ < b.dim_;
    if (a.kind_ == Kind::partial) return a.reduce_ < b.reduce_;
    return false;
  }

 private:
  Kind kind_ = Kind::replicate;
  int64_t dim_ = 0;
  ReduceOp reduce_ = ReduceOp::sum;
};

/// One placement per mesh axis, in mesh-axis order.
using Placements = std::vector<Placement>;

/// "(S(0), R)".
std::string str(const Placements& placements);
/// Parses what str() prints ("S(0)", "R", "P(sum)", "(S(0), R)"); throws naming the text.
Placement parse_placement(const std::string& text);
Placements parse_placements(const std::string& text);
/// Placements with Shard dims wrapped against `ndim` (negative dims count from the end);
/// throws naming `op` when a dim is out of range.
Placements normalize_placements(const Placements& placements, int64_t ndim, const char* op);
/// Every axis Replicate.
Placements replicated(size_t mesh_ndim);
/// True when the Partial placements of a layout can combine: all sum/avg, or all max, or all
/// min (a tensor partial by sum on one axis and by max on another has no single value).
bool partials_compatible(const Placements& placements);
/// Every layout of a tensor of `tensor_ndim` dims on a mesh of `mesh_ndim` axes (each axis
/// Replicate, Partial(sum|avg|max|min) or Shard(d)) whose partials are compatible.
std::vector<Placements> all_placements(size_t mesh_ndim, int64_t tensor_ndim);

}  // namespace quilt
