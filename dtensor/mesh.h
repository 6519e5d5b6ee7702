// DeviceMesh: the ranks of a communicator arranged as an n-D grid with named axes
// (dp_replicate, dp_shard, cp, tp, pp, ep, ...). Each axis has its own communicator — the ranks
// that differ only in that coordinate — built once, by split, when the mesh is made. Ranks are
// laid out row-major (the last axis varies fastest), as torchtitan lays out its meshes.
//
//   DeviceMesh mesh(world_ptr(), {2, 4}, {"dp", "tp"});   // collective over the world
//   DeviceMesh tp = mesh["tp"];                           // 1-D sub-mesh, no communication
//   DeviceMesh dp_cp = mesh3d[{"dp_shard", "cp"}];        // flattened axis "dp_shard_cp"
//   mesh.comm(1).all_reduce(t);                           // over the tp group of this rank
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "engine/tensor.h"

namespace quilt {

namespace detail {
struct MeshState;
}

/// An n-D arrangement of ranks with one communicator per axis. A cheap, shareable handle: copies
/// refer to the same mesh. Sub-meshes and flattened meshes are built once and cached.
class DeviceMesh {
 public:
  DeviceMesh() = default;
  /// A mesh over every rank of `comm`: prod(shape) must equal comm->size(). Collective over
  /// `comm` (every rank must build the same meshes in the same order). Axis names must be
  /// distinct and non-empty.
  DeviceMesh(std::shared_ptr<Communicator> comm, Shape shape, std::vector<std::string> axis_names);
  /// A 1-D mesh over `comm` with the axis named `axis_name`.
  static DeviceMesh one_d(std::shared_ptr<Communicator> comm, const std::string& axis_name = "world");

  bool defined() const { return state_ != nullptr; }
  /// Number of axes.
  int64_t ndim() const;
  /// Size of every axis.
  const Shape& shape() const;
  /// Size of axis `axis` (negative counts from the end).
  int64_t size(int64_t axis) const;
  /// Total number of ranks in the mesh.
  int64_t size() const;
  const std::vector<std::string>& axis_names() const;
  /// Index of the axis called `name`; throws listing the mesh's axes when there is none.
  int64_t axis(const std::string& name) const;
  /// This rank's coordinate along every axis.
  const Shape& coordinate() const;
  /// This rank's coordinate along axis `axis`.
  int64_t coordinate(int64_t axis) const;
  /// This rank's row-major index in the mesh (its rank in comm()).
  int rank() const;
  /// The communicator over all ranks of the mesh.
  Communicator& comm() const;
  /// The communicator of axis `axis`: this rank's group of ranks differing only along it.
  Communicator& comm(int64_t axis) const;
  std::shared_ptr<Communicator> comm_ptr(int64_t axis) const;
  /// Ranks (in the communicator the outermost mesh was built on) of every mesh position, row-major.
  const std::vector<int>& ranks() const;
  /// The communicator of the outermost mesh this one was cut from (ranks() index it).
  std::shared_ptr<Communicator> root_comm() const;

  /// The 1-D sub-mesh of axis `name` through this rank (no communication).
  DeviceMesh operator[](const std::string& name) const;
  /// The axes `names` flattened into one axis named by joining them with '_' (torchtitan's
  /// dp_shard_cp); collective over this mesh the first time, cached afterwards.
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  /// mesh[{"dp_shard", "cp"}]: the braced form of the flattening operator[].
  DeviceMesh operator[](std::initializer_list<std::string> names) const {
    return flatten(std::vector<std::string>(names));
  }
  /// The sub-mesh of the axes `names` (kept in the mesh's axis order), through this rank;
  /// collective over this mesh the first time for more than one axis.
  DeviceMesh sub(const std::vector<std::string>& names) const;
  /// The axes `names` flattened into one axis called `new_name` ("" joins the names with '_').
  DeviceMesh flatten(const std::vector<std::string>& names, const std::string& new_name = "") const;

  /// "DeviceMesh(dp=2, tp=4)".
  std::string str() const;
  /// Same ranks in the same arrangement with the same axis names, built from one communicator.
  friend bool operator==(const DeviceMesh& a, const DeviceMesh& b);
  friend bool operator!=(const DeviceMesh& a, const DeviceMesh& b) { return !(a == b); }

 private:
  explicit DeviceMesh(std::shared_ptr<detail::MeshState> s) : state_(std::move(s)) {}
  const detail::MeshState& state() const;
  std::shared_ptr<detail::MeshState> state_;
};

}  // namespace quilt
