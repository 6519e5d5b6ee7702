// Sharding rules of view ops (view/reshape, permute, expand, slice). Views move values, never
// combine them, so every Partial passes through. Shard dims map through the view: a reshape
// groups input and output dims with equal products, and a group's first non-1 dim carries the
// shard — valid exactly when every rank's piece is the same run of elements before and after
// (checked on every mesh coordinate, so uneven shards stay correct or are gathered).
// View attributes are global shapes, so the local computation views the shard at its local shape.
#include <algorithm>

#include "dtensor/rules/rules.h"
#include "dtensor/sharding.h"
#include "engine/autograd.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"

namespace quilt::rules {
namespace {

const ReduceOp kAllOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

void add_partial_rows(std::vector<Row>& rows) {
  for (ReduceOp op : kAllOps) rows.push_back({{Partial(op)}, {Partial(op)}});
}

struct Group {
  std::vector<int64_t> in, out;
  int64_t in_anchor = -1, out_anchor = -1;  // first dim of size > 1 on each side
};

// Input and output dims in groups of equal element count (shapes with elements only).
std::vector<Group> view_groups(const Shape& in, const Shape& out) {
  std::vector<Group> groups;
  size_t i = 0, j = 0;
  while (i < in.size() || j < out.size()) {
    Group g;
    int64_t pi = 1, pj = 1;
    if (i < in.size()) { g.in.push_back(int64_t(i)); pi *= in[i++]; }
    if (j < out.size()) { g.out.push_back(int64_t(j)); pj *= out[j++]; }
    while (pi != pj) {
      if (pi < pj && i < in.size()) { g.in.push_back(int64_t(i)); pi *= in[i++]; }
      else if (j < out.size()) { g.out.push_back(int64_t(j)); pj *= out[j++]; }
      else break;
    }
    for (int64_t d : g.in)
      if (in[size_t(d)] > 1) { g.in_anchor = d; break; }
    for (int64_t d : g.out)
      if (out[size_t(d)] > 1) { g.out_anchor = d; break; }
    groups.push_back(std::move(g));
  }
  return groups;
}

int64_t product_after(const Shape& s, const std::vector<int64_t>& dims, int64_t anchor) {
  int64_t p = 1;
  for (int64_t d : dims)
    if (d > anchor) p *= s[size_t(d)];
  return p;
}

Strategy view_rule(const OpInfo& info) {
  const Shape in = info.args[0].shape;
  const Shape out = info.attr<Shape>("shape");
  Strategy s;
  s.out_shapes = {out};
  if (numel_of(in) > 0) {
    auto groups = std::make_shared<std::vector<Group>>(view_groups(in, out));
    for (const Group& g : *groups)
      if (g.in_anchor >= 0 && g.out_anchor >= 0) s.rows.push_back({{Shard(g.out_anchor)}, {Shard(g.in_anchor)}});
    // Each rank's run of elements in every group must be the same before and after the view.
    s.check = [groups, in, out](const Shape& mesh_shape, const std::vector<Placements>& pin,
                                const std::vector<Placements>& pout) {
      bool sharded = false;
      for (const Placement& p : pin[0]) sharded = sharded || p.is_shard();
      if (!sharded) return true;
      for (const Shape& c : all_coordinates(mesh_shape)) {
        const Block bi = local_block(in, mesh_shape, pin[0], c);
        const Block bo = local_block(out, mesh_shape, pout[0], c);
        for (const Group& g : *groups) {
          if (g.in_anchor < 0 || g.out_anchor < 0) continue;
          const int64_t ii = product_after(in, g.in, g.in_anchor), io = product_after(out, g.out, g.out_anchor);
          const size_t a = size_t(g.in_anchor), b = size_t(g.out_anchor);
          if (bi.offset[a] * ii != bo.offset[b] * io || bi.shape[a] * ii != bo.shape[b] * io) return false;
        }
      }
      return true;
    };
  }
  add_partial_rows(s.rows);
  s.local = [](Primitive&, const std::vector<Tensor>& locals, const LocalContext& ctx) -> std::vector<Tensor> {
    return {reshape(locals[0], ctx.local_out_shape(0))};
  };
  return s;
}

}  // namespace

void register_view_rules(Registry& r) {
  r.add("view", [](const OpInfo& info) -> std::optional<Strategy> { return view_rule(info); });

  // permute moves dims: output dim i is input dim dims[i], shard and all.
  r.add("permute", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& dims = info.attr<Shape>("dims");
    const Shape& in = info.args[0].shape;
    Strategy s;
    Shape out;
    for (int64_t d : dims) out.push_back(in[size_t(d)]);
    s.out_shapes = {out};
    for (size_t i = 0; i < dims.size(); ++i) s.rows.push_back({{Shard(int64_t(i))}, {Shard(dims[i])}});
    add_partial_rows(s.rows);
    return s;
  });

  // expand: kept dims stay sharded; a dim broadcast from size 1 (or a new leading dim) can be
  // sharded in the output from a replicated input — each rank expands to its own piece.
  r.add("expand", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& out = info.attr<Shape>("shape");
    const Shape& in = info.args[0].shape;
    const int64_t lead = int64_t(out.size()) - int64_t(in.size());
    Strategy s;
    s.out_shapes = {out};
    for (int64_t d = 0; d < int64_t(out.size()); ++d) {
      const int64_t id = d - lead;
      if (id >= 0 && in[size_t(id)] == out[size_t(d)]) s.rows.push_back({{Shard(d)}, {Shard(id)}});
      else s.rows.push_back({{Shard(d)}, {Replicate()}});
    }
    add_partial_rows(s.rows);
    s.local = [](Primitive&, const std::vector<Tensor>& locals, const LocalContext& ctx) -> std::vector<Tensor> {
      return {expand(locals[0], ctx.local_out_shape(0))};
    };
    return s;
  });

  // slice keeps shards of every other dim; the sliced dim is needed whole (its attributes are
  // global positions), which the primitive's own forward then reads correctly.
  r.add("slice", [](const OpInfo& info) -> std::optional<Strategy> {
    const int64_t dim = info.attr<int64_t>("dim");
    Shape out = info.args[0].shape;
    out[size_t(dim)] = info.attr<int64_t>("length");
    Strategy s;
    s.out_shapes = {out};
    for (int64_t d = 0; d < int64_t(out.size()); ++d)
      if (d != dim) s.rows.push_back({{Shard(d)}, {Shard(d)}});
    add_partial_rows(s.rows);
    return s;
  });

  // slice_backward (g -> zeros of the input's shape with g in the window): the adjoint of slice,
  // so its table mirrors slice's; zeros outside the window are a valid piece of every Partial.
  // Expects attributes dim, start, step and the input's "shape".
  r.add("slice_backward", [](const OpInfo& info) -> std::optional<Strategy> {
    if (!info.has_attr("shape") || !info.has_attr("dim") || !info.has_attr("start") || !info.has_attr("step"))
      return std::nullopt;
    const int64_t dim = info.attr<int64_t>("dim");
    const int64_t start = info.attr<int64_t>("start"), step = info.attr<int64_t>("step");
    Strategy s;
    s.out_shapes = {info.attr<Shape>("shape")};
    for (int64_t d = 0; d < int64_t(s.out_shapes[0].size()); ++d)
      if (d != dim) s.rows.push_back({{Shard(d)}, {Shard(d)}});
    add_partial_rows(s.rows);
    s.local = [dim, start, step](Primitive&, const std::vector<Tensor>& locals, const LocalContext& ctx) -> std::vector<Tensor> {
      const Tensor& g = locals[0];
      Tensor out = zeros(ctx.local_out_shape(0), {.dtype = g.dtype(), .device = g.device()});
      const int64_t len = g.size(dim);
      if (len > 0 && g.numel() > 0) out.slice(dim, start, start + (len - 1) * step + 1, step).copy_(g);
      return {out};
    };
    return s;
  });
}

}  // namespace quilt::rules
