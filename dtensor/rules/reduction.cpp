// Sharding rules of reductions (sum, max, min, argmax, sum_squares over some dims).
// Reducing over a sharded dim leaves each rank the reduction of its piece: Partial of the same
// reduction. Dims that are kept stay sharded (renumbered when the reduced dims disappear).
#include <algorithm>
#include <limits>

#include "dtensor/rules/rules.h"
#include "engine/ops/creation.h"

namespace quilt::rules {
namespace {

struct Reduced {
  Shape dims;
  bool keepdim = false;
  Shape out_shape;
  Shape out_dim;  // per input dim: its output dim, or -1 when reduced away
};

Reduced reduced(const OpInfo& info) {
  Reduced r;
  r.dims = info.attr<Shape>("dims");
  r.keepdim = info.attr<bool>("keepdim");
  const Shape& in = info.args[0].shape;
  for (int64_t d = 0; d < int64_t(in.size()); ++d) {
    const bool red = std::find(r.dims.begin(), r.dims.end(), d) != r.dims.end();
    if (red && !r.keepdim) { r.out_dim.push_back(-1); continue; }
    r.out_dim.push_back(int64_t(r.out_shape.size()));
    r.out_shape.push_back(red ? 1 : in[size_t(d)]);
  }
  return r;
}

bool is_reduced(const Reduced& r, int64_t d) { return std::find(r.dims.begin(), r.dims.end(), d) != r.dims.end(); }

// Rows for a reduction whose piece-wise results combine by `combine` (nullopt: they do not, so a
// reduced dim cannot be sharded), passing through Partial inputs listed in `pass`.
Strategy reduction(const OpInfo& info, std::optional<Placement> combine, std::vector<Placement> pass) {
  const Reduced r = reduced(info);
  Strategy s;
  s.out_shapes = {r.out_shape};
  for (int64_t d = 0; d < int64_t(info.args[0].shape.size()); ++d) {
    if (!is_reduced(r, d)) s.rows.push_back({{Shard(r.out_dim[size_t(d)])}, {Shard(d)}});
    else if (combine) s.rows.push_back({{*combine}, {Shard(d)}});
  }
  for (const Placement& p : pass) s.rows.push_back({{p}, {p}});
  return s;
}

enum class Kind { sum, max, min, argmax, sum_squares };

// The local reduction, safe on empty shards (uneven shards of small dims): an empty output is
// made without running the kernel (argmax and max refuse empty inputs), and a max/min over an
// empty piece gives the reduction's identity, which the Partial combine then ignores.
LocalFn local_reduce(Kind kind) {
  return [kind](Primitive& prim, const std::vector<Tensor>& locals, const LocalContext& ctx) -> std::vector<Tensor> {
    const Tensor& x = locals[0];
    const Shape out = ctx.local_out_shape(0);
    DType dt = x.dtype();
    if (kind == Kind::argmax || ((kind == Kind::sum || kind == Kind::sum_squares) && !is_floating(dt))) dt = DType::i64;
    if (numel_of(out) == 0) return {Tensor::empty(out, {.dtype = dt, .device = x.device()})};
    if (x.numel() > 0 || (kind != Kind::max && kind != Kind::min)) return prim.forward(locals);
    const bool is_max = kind == Kind::max;
    double v;
    if (is_floating(dt)) v = is_max ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
    else if (dt == DType::i32) v = is_max ? double(std::numeric_limits<int32_t>::min()) : double(std::numeric_limits<int32_t>::max());
    else if (dt == DType::b8) v = is_max ? 0.0 : 1.0;
    else v = is_max ? double(std::numeric_limits<int64_t>::min()) : double(std::numeric_limits<int64_t>::max());
    return {full(out, v, {.dtype = dt, .device = x.device()})};
  };
}

Strategy with_local(Strategy s, Kind kind) {
  s.local = local_reduce(kind);
  return s;
}

}  // namespace

void register_reduction_rules(Registry& r) {
  // sum over a sharded dim: sum over all = sum over ranks of the sum over each rank's piece.
  // A sum of Partial(sum) pieces is the Partial(sum) of the sums (linear); means likewise.
  r.add("sum", [](const OpInfo& info) -> std::optional<Strategy> {
    return with_local(reduction(info, Partial(ReduceOp::sum), {Partial(ReduceOp::sum), Partial(ReduceOp::avg)}),
                      Kind::sum);
  });
  // max over a sharded dim: the max of the per-rank maxima; max of Partial(max) pieces likewise.
  r.add("max", [](const OpInfo& info) -> std::optional<Strategy> {
    return with_local(reduction(info, Partial(ReduceOp::max), {Partial(ReduceOp::max)}), Kind::max);
  });
  r.add("min", [](const OpInfo& info) -> std::optional<Strategy> {
    return with_local(reduction(info, Partial(ReduceOp::min), {Partial(ReduceOp::min)}), Kind::min);
  });
  // A sum of squares over all dims: the squares of each rank's piece sum to its share. Squaring
  // is not linear, so Partial inputs are reduced first.
  r.add("sum_squares", [](const OpInfo& info) -> std::optional<Strategy> {
    return with_local(reduction(info, Partial(ReduceOp::sum), {}), Kind::sum_squares);
  });
  // argmax needs the whole reduced dim (the position is global); other dims stay sharded.
  r.add("argmax", [](const OpInfo& info) -> std::optional<Strategy> {
    return with_local(reduction(info, std::nullopt, {}), Kind::argmax);
  });
}

}  // namespace quilt::rules
