// Helpers shared by the dtensor tests: meshes over a threads group, random distributed inputs
// (with genuinely random Partial pieces) and comparisons against the plain global value.
#pragma once

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "dtensor/dtensor.h"
#include "dtensor/sharding.h"
#include "engine/engine.h"

namespace quilt::test {

/// A mesh of `shape` over every rank of `c` (axes named a0, a1, ...).
inline DeviceMesh mesh_of_shape(Communicator& c, const Shape& shape) {
  std::vector<std::string> names;
  for (size_t i = 0; i < shape.size(); ++i) names.push_back("a" + std::to_string(i));
  return DeviceMesh(c.shared_from_this(), shape, names);
}

/// Largest |a - b| over all elements (both plain, same shape); +inf on a shape mismatch.
inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return INFINITY;
  const auto va = a.to_vector(), vb = b.to_vector();
  double m = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    if (std::isnan(va[i]) && std::isnan(vb[i])) continue;
    m = std::max(m, std::fabs(va[i] - vb[i]));
  }
  return m;
}

/// A distributed tensor whose global value is `global` (the same on every rank), with random
/// Partial pieces: sum/avg pieces differ by noise that cancels over the axis, max/min pieces
/// lie below/above the value except on coordinate 0 (so a wrong combine shows).
inline Tensor make_dist(const Tensor& global, const DeviceMesh& mesh, const Placements& placements, uint64_t seed) {
  NoGradGuard ng;
  Tensor x = distribute_tensor(global, mesh, placements);
  if (!is_floating(global.dtype())) return x;
  const Placements pl = placements_of(x);
  Tensor local = x.local();
  const Shape& coord = mesh.coordinate();
  // Pieces must be identical along Replicate axes, so the noise ignores those coordinates.
  auto noise_at = [&](const Shape& c, size_t axis) {
    std::string key = "noise" + std::to_string(axis);
    for (size_t b = 0; b < c.size(); ++b) key += "," + (pl[b].is_replicate() ? std::string("*") : std::to_string(c[b]));
    return randn(local.shape(), RngKey(seed, key), {.dtype = global.dtype()});
  };
  for (size_t a = 0; a < pl.size(); ++a) {
    if (!pl[a].is_partial() || mesh.size(int64_t(a)) == 1) continue;
    const ReduceOp op = pl[a].reduce_op();
    if (op == ReduceOp::sum || op == ReduceOp::avg) {
      Shape next = coord;
      next[a] = (coord[a] + 1) % mesh.size(int64_t(a));
      local.add_(noise_at(coord, a) - noise_at(next, a));  // telescopes to zero over the axis
    } else if (coord[a] != 0) {
      Tensor n = abs(noise_at(coord, a));
      local.add_(op == ReduceOp::max ? neg(n) : n);
    }
  }
  return x;
}

/// Random mesh shapes of 1, 2 or 3 axes with at most `max_ranks` ranks.
inline Shape random_mesh_shape(std::mt19937& rng, int max_ranks) {
  static const std::vector<Shape> shapes = {{1}, {2}, {3}, {4}, {5}, {8}, {1, 2}, {2, 1}, {2, 2},
                                            {2, 3}, {3, 2}, {2, 4}, {4, 2}, {2, 2, 2}, {1, 2, 3}, {2, 1, 2}};
  std::vector<Shape> ok;
  for (const Shape& s : shapes)
    if (numel_of(s) <= max_ranks) ok.push_back(s);
  return ok[std::uniform_int_distribution<size_t>(0, ok.size() - 1)(rng)];
}

}  // namespace quilt::test
