// DistSpec: what makes a Tensor distributed — the mesh, one placement per mesh axis and the
// global shape (with its contiguous strides). The engine carries it on TensorImpl::dist and
// knows nothing else about it; dtensor/ builds and reads it.
//
//   auto spec = std::make_shared<DistSpec>(mesh, Placements{Shard(0)}, Shape{10, 4});
//   spec->local_shape();   // this rank's shard: (3, 4) on rank 0 of 4, (1, 4) on rank 3
#pragma once

#include <memory>
#include <string>

#include "dtensor/mesh.h"
#include "dtensor/placement.h"
#include "engine/tensor.h"

namespace quilt {

/// Mesh + placements + global shape of a distributed tensor.
struct DistSpec {
  DeviceMesh mesh;
  Placements placements;  // one per mesh axis, Shard dims normalised to [0, ndim)
  Shape shape;            // global
  Shape strides;          // global, contiguous

  /// Validates: one placement per axis, Shard dims in range, Partial reductions that combine
  /// (sum and avg mix; max or min only with themselves). Throws naming the placements.
  DistSpec(DeviceMesh mesh, Placements placements, Shape shape);

  /// This rank's shard shape.
  Shape local_shape() const;
  /// Where this rank's shard starts in the global tensor.
  Shape local_offset() const;
  /// True when some axis is Partial.
  bool has_partial() const;
  /// "DistSpec(mesh=DeviceMesh(dp=2), placements=(S(0)), shape=(10, 4))".
  std::string str() const;
};

/// Same mesh, placements and global shape.
bool operator==(const DistSpec& a, const DistSpec& b);
inline bool operator!=(const DistSpec& a, const DistSpec& b) { return !(a == b); }

/// The spec of a distributed tensor; throws naming `op` when `t` is not distributed.
const DistSpec& dist_spec_of(const Tensor& t, const char* op = "dtensor");

}  // namespace quilt
