// Chunk arithmetic of sharded dims, shared by redistribute, the sharding rules and checkpoints.
// A dim of size n sharded over an axis of size k follows torch.chunk: chunk = ceil(n / k), and
// coordinate i holds [min(i * chunk, n), min((i + 1) * chunk, n)) — so any n works on any k,
// trailing coordinates may hold fewer elements or none. A dim sharded over several axes is cut
// in mesh-axis order: the first axis cuts the dim, the next cuts each piece, and so on.
//
//   chunk_of(10, 4, 3)  == Chunk{9, 1}           // sizes 3, 3, 3, 1
//   chunk_of(2, 4, 3)   == Chunk{2, 0}           // sizes 1, 1, 0, 0
//   local_block({10, 6}, {2, 2}, {Shard(0), Shard(0)}, {1, 1}).offset == {8, 0}
#pragma once

#include <cstdint>
#include <vector>

#include "dtensor/placement.h"
#include "engine/tensor.h"

namespace quilt {

/// A half-open range [offset, offset + size) of one dim.
struct Chunk {
  int64_t offset = 0;
  int64_t size = 0;
  friend bool operator==(const Chunk&, const Chunk&) = default;
};

/// Piece `i` of a dim of size `n` cut into `k` torch.chunk pieces.
Chunk chunk_of(int64_t n, int64_t k, int64_t i);
/// Sizes of all `k` pieces of a dim of size `n`.
std::vector<int64_t> chunk_sizes(int64_t n, int64_t k);

/// A block of a global tensor: start and extent in every dim.
struct Block {
  Shape offset;
  Shape shape;
};

/// The block that mesh coordinate `coord` holds of a tensor of `global_shape` placed by
/// `placements` on a mesh of `mesh_shape` (Partial and Replicate axes do not cut).
Block local_block(const Shape& global_shape, const Shape& mesh_shape, const Placements& placements,
                  const Shape& coord);
/// The range of `dim` at coordinate `coord` after cutting only by the axes before `axis` —
/// the piece that axis `axis` splits (or gathers) when it shards `dim` innermost.
Chunk piece_before_axis(const Shape& global_shape, const Shape& mesh_shape, const Placements& placements,
                        const Shape& coord, int64_t axis, int64_t dim);
/// Every coordinate of a mesh of `mesh_shape`, row-major.
std::vector<Shape> all_coordinates(const Shape& mesh_shape);

}  // namespace quilt
