// Chunk arithmetic (torch.chunk semantics, nested in mesh-axis order) and DistSpec.
#include "dtensor/sharding.h"

#include <algorithm>

#include "dtensor/dist_spec.h"

namespace quilt {

Chunk chunk_of(int64_t n, int64_t k, int64_t i) {
  QUILT_CHECK(k >= 1 && i >= 0 && i < k && n >= 0, "[sharding] chunk ", i, " of ", k, " pieces of a dim of size ",
              n);
  const int64_t c = (n + k - 1) / k;
  const int64_t begin = std::min(i * c, n), end = std::min((i + 1) * c, n);
  return {begin, end - begin};
}

std::vector<int64_t> chunk_sizes(int64_t n, int64_t k) {
  std::vector<int64_t> s(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) s[size_t(i)] = chunk_of(n, k, i).size;
  return s;
}

Block local_block(const Shape& global_shape, const Shape& mesh_shape, const Placements& placements,
                  const Shape& coord) {
  Block b{Shape(global_shape.size(), 0), global_shape};
  for (size_t a = 0; a < placements.size(); ++a) {
    if (!placements[a].is_shard()) continue;
    const size_t d = size_t(placements[a].dim());
    const Chunk c = chunk_of(b.shape[d], mesh_shape[a], coord[a]);
    b.offset[d] += c.offset;
    b.shape[d] = c.size;
  }
  return b;
}

Chunk piece_before_axis(const Shape& global_shape, const Shape& mesh_shape, const Placements& placements,
                        const Shape& coord, int64_t axis, int64_t dim) {
  Chunk piece{0, global_shape[size_t(dim)]};
  for (int64_t a = 0; a < axis; ++a) {
    if (!placements[size_t(a)].is_shard(dim)) continue;
    const Chunk c = chunk_of(piece.size, mesh_shape[size_t(a)], coord[size_t(a)]);
    piece = {piece.offset + c.offset, c.size};
  }
  return piece;
}

std::vector<Shape> all_coordinates(const Shape& mesh_shape) {
  const int64_t n = numel_of(mesh_shape);
  std::vector<Shape> out;
  out.reserve(size_t(n));
  for (int64_t r = 0; r < n; ++r) {
    Shape c(mesh_shape.size());
    int64_t rem = r;
    for (size_t i = mesh_shape.size(); i-- > 0;) {
      c[i] = rem % mesh_shape[i];
      rem /= mesh_shape[i];
    }
    out.push_back(std::move(c));
  }
  return out;
}

// ---- DistSpec ----

namespace {
// Partial reductions that can sit on different axes at once: sum and avg are both linear (their
// order does not matter); max or min only combine with themselves.
int partial_family(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return 0;
    case ReduceOp::max: return 1;
    case ReduceOp::min: return 2;
  }
  return 3;
}
}  // namespace

DistSpec::DistSpec(DeviceMesh m, Placements p, Shape s)
    : mesh(std::move(m)), placements(std::move(p)), shape(std::move(s)) {
  QUILT_CHECK(mesh.defined(), "[dtensor] a distributed tensor needs a defined mesh");
  QUILT_CHECK(int64_t(placements.size()) == mesh.ndim(), "[dtensor] ", placements.size(), " placements ",
              quilt::str(placements), " for the ", mesh.ndim(), "-D mesh ", mesh.str());
  placements = normalize_placements(placements, int64_t(shape.size()), "dtensor");
  int family = -1;
  for (const Placement& pl : placements) {
    if (!pl.is_partial()) continue;
    const int f = partial_family(pl.reduce_op());
    QUILT_CHECK(family < 0 || family == f, "[dtensor] placements ", quilt::str(placements),
                " mix Partial reductions that do not commute (sum/avg, max and min cannot be combined)");
    family = f;
  }
  strides = contiguous_strides(shape);
}

Shape DistSpec::local_shape() const { return local_block(shape, mesh.shape(), placements, mesh.coordinate()).shape; }
Shape DistSpec::local_offset() const {
  return local_block(shape, mesh.shape(), placements, mesh.coordinate()).offset;
}
bool DistSpec::has_partial() const {
  return std::any_of(placements.begin(), placements.end(), [](const Placement& p) { return p.is_partial(); });
}

std::string DistSpec::str() const {
  return detail::concat("DistSpec(mesh=", mesh.str(), ", placements=", quilt::str(placements), ", shape=", shape, ")");
}

bool operator==(const DistSpec& a, const DistSpec& b) {
  return a.shape == b.shape && a.placements == b.placements && a.mesh == b.mesh;
}

const DistSpec& dist_spec_of(const Tensor& t, const char* op) {
  QUILT_CHECK(t.defined() && t.is_distributed(), "[", op, "] expected a distributed tensor, got ",
              t.defined() ? "a plain tensor of shape " + detail::concat(t.shape()) : std::string("an undefined tensor"));
  return *t.dist_spec();
}

}  // namespace quilt
