// Sharding rules of the neural-network ops. Ops that normalise along one dim (softmax family,
// rms_norm, layer_norm, cross_entropy's rows) keep any other dim sharded and need that dim
// whole; their backward ops are linear in the incoming gradient, and the weight gradients sum
// over rows (Partial(sum) when rows are sharded). embedding also runs vocab-parallel: each rank
// looks up the rows it holds and zeros elsewhere, so the output is Partial(sum).
#include <algorithm>

#include "dtensor/rules/rules.h"
#include "dtensor/sharding.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/nn.h"
#include "engine/ops/view.h"

namespace quilt::rules {
namespace {

const Placement kRep = Replicate();
const Placement kSum = Partial(ReduceOp::sum);
const Placement kAvg = Partial(ReduceOp::avg);

Shape lead(const Shape& s) { return Shape(s.begin(), s.end() - 1); }

// softmax-like: elementwise over every dim but `dim` (inputs of one shape).
Strategy rowwise(const OpInfo& info, int64_t dim) {
  Strategy s;
  const Shape out = broadcast_all(info);
  s.out_shapes = {out};
  for (Row& r : pointwise_shard_rows(info, out))
    if (!r.out[0].is_shard(dim)) s.rows.push_back(std::move(r));
  return s;
}

// Rows for norm forward ops: x's leading dims shard x, y and the per-row statistics; weight and
// bias (every other input) are needed whole.
Strategy norm_forward(const OpInfo& info, size_t n_stats) {
  const Shape& x = info.args[0].shape;
  Strategy s;
  s.out_shapes.push_back(x);
  for (size_t i = 0; i < n_stats; ++i) s.out_shapes.push_back(lead(x));
  for (int64_t d = 0; d + 1 < int64_t(x.size()); ++d) {
    Row r;
    r.out.assign(1 + n_stats, Shard(d));
    r.in.assign(info.args.size(), kRep);
    r.in[0] = Shard(d);
    s.rows.push_back(std::move(r));
  }
  return s;
}

// Rows for norm backward ops (g, x, [w], stats...) -> (gx, weight grads...): rows shard g, x
// and the statistics alike; weight gradients are sums over rows. Linear in g for fixed x.
Strategy norm_backward(const OpInfo& info, size_t n_stats, size_t n_wgrads) {
  const Shape& x = info.args[1].shape;
  const size_t n_in = info.args.size();
  Strategy s;
  s.out_shapes.push_back(x);
  for (size_t i = 0; i < n_wgrads; ++i) s.out_shapes.push_back({x.back()});
  for (int64_t d = 0; d + 1 < int64_t(x.size()); ++d) {
    Row r;
    r.out.assign(1 + n_wgrads, kSum);  // sum over the rows each rank holds
    r.out[0] = Shard(d);
    r.in.assign(n_in, kRep);
    r.in[0] = r.in[1] = Shard(d);
    for (size_t i = n_in - n_stats; i < n_in; ++i) r.in[i] = Shard(d);
    s.rows.push_back(std::move(r));
  }
  for (const Placement& p : {kSum, kAvg}) {
    Row r;
    r.out.assign(1 + n_wgrads, p);
    r.in.assign(n_in, kRep);
    r.in[0] = p;
    s.rows.push_back(std::move(r));
  }
  return s;
}

// embedding with the weight cut along the vocabulary: this rank looks up the rows in its range
// and leaves zeros for the others, so the ranks' outputs sum to the full lookup.
LocalFn vocab_parallel_lookup(Shape weight_shape) {
  return [weight_shape](Primitive& prim, const std::vector<Tensor>& locals, const LocalContext& ctx) -> std::vector<Tensor> {
    bool cut = false;
    for (const Placement& p : ctx.in_placements[0]) cut = cut || p.is_shard(0);
    if (!cut) return prim.forward(locals);
    const Tensor& w = locals[0];
    const Tensor& idx = locals[1];
    const int64_t first =
        local_block(weight_shape, ctx.mesh.shape(), ctx.in_placements[0], ctx.mesh.coordinate()).offset[0];
    const int64_t rows = w.size(0);
    if (rows == 0) return {zeros(ctx.local_out_shape(0), {.dtype = w.dtype(), .device = w.device()})};
    const Tensor mine = logical_and(ge(idx, scalar_like(double(first), idx)), lt(idx, scalar_like(double(first + rows), idx)));
    const Tensor local_idx = where(mine, idx - double(first), zeros({}, {.dtype = idx.dtype(), .device = idx.device()}));
    return {embedding(w, local_idx) * unsqueeze(cast(mine, w.dtype()), -1)};
  };
}

}  // namespace

void register_nn_rules(Registry& r) {
  // softmax along `dim`: every other dim is independent rows.
  for (const char* name : {"softmax", "log_softmax"}) {
    r.add(name, [](const OpInfo& info) -> std::optional<Strategy> {
      if (!info.has_attr("dim")) return std::nullopt;
      return rowwise(info, info.attr<int64_t>("dim"));
    });
  }
  // The backward of softmax is linear in g for a fixed output y: y * (g - sum(g * y)) (and
  // g - exp(y) * sum(g) for log_softmax), so a Partial g with a replicated y stays Partial.
  for (const char* name : {"softmax_backward", "log_softmax_backward"}) {
    r.add(name, [](const OpInfo& info) -> std::optional<Strategy> {
      if (!info.has_attr("dim")) return std::nullopt;
      Strategy s = rowwise(info, info.attr<int64_t>("dim"));
      s.rows.push_back({{kSum}, {kSum, kRep}});
      s.rows.push_back({{kAvg}, {kAvg, kRep}});
      return s;
    });
  }
  // (x, [weight]) -> (y, rstd) and (x, [weight], [bias]) -> (y, mean, rstd).
  r.add("rms_norm", [](const OpInfo& info) -> std::optional<Strategy> { return norm_forward(info, 1); });
  r.add("layer_norm", [](const OpInfo& info) -> std::optional<Strategy> { return norm_forward(info, 2); });
  // (g, x, [weight], rstd) -> (gx, [gw]) and (g, x, [weight], mean, rstd) -> (gx, gw, gb).
  r.add("rms_norm_backward", [](const OpInfo& info) -> std::optional<Strategy> { return norm_backward(info, 1, 1); });
  r.add("layer_norm_backward", [](const OpInfo& info) -> std::optional<Strategy> { return norm_backward(info, 2, 2); });

  // (weight (V, D), indices (*)) -> (*, D): positions shard like the indices, the feature dim
  // like the weight's columns; a vocabulary-cut weight gives Partial(sum) (see above); and the
  // lookup is linear in the weight.
  r.add("embedding", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& w = info.args[0].shape;
    const Shape& idx = info.args[1].shape;
    Strategy s;
    Shape out = idx;
    out.push_back(w[1]);
    s.out_shapes = {out};
    for (int64_t d = 0; d < int64_t(idx.size()); ++d) s.rows.push_back({{Shard(d)}, {kRep, Shard(d)}});
    s.rows.push_back({{Shard(int64_t(idx.size()))}, {Shard(1), kRep}});
    s.rows.push_back({{kSum}, {Shard(0), kRep}});
    s.rows.push_back({{kSum}, {kSum, kRep}});
    s.rows.push_back({{kAvg}, {kAvg, kRep}});
    s.local = vocab_parallel_lookup(w);
    return s;
  });
  // (g (*, D), indices (*)) -> (V, D): rows of g summed at their indices — a sum over positions
  // (Partial(sum) when positions are sharded), column-parallel along D, and linear in g.
  r.add("embedding_backward", [](const OpInfo& info) -> std::optional<Strategy> {
    if (!info.has_attr("vocab")) return std::nullopt;
    const Shape& g = info.args[0].shape;
    const Shape& idx = info.args[1].shape;
    Strategy s;
    s.out_shapes = {{info.attr<int64_t>("vocab"), g.back()}};
    for (int64_t d = 0; d < int64_t(idx.size()); ++d) s.rows.push_back({{kSum}, {Shard(d), Shard(d)}});
    s.rows.push_back({{Shard(1)}, {Shard(int64_t(g.size()) - 1), kRep}});
    s.rows.push_back({{kSum}, {kSum, kRep}});
    s.rows.push_back({{kAvg}, {kAvg, kRep}});
    return s;
  });

  // Cross entropy rows are independent: (logits (N, C), target (N)) -> loss (N).
  r.add("cross_entropy", [](const OpInfo& info) -> std::optional<Strategy> {
    Strategy s;
    s.out_shapes = {{info.args[0].shape[0]}};
    s.rows.push_back({{Shard(0)}, {Shard(0), Shard(0)}});
    return s;
  });
  // (g (N), logits, target) -> (N, C): rows alike, and linear in g.
  r.add("cross_entropy_backward", [](const OpInfo& info) -> std::optional<Strategy> {
    Strategy s;
    s.out_shapes = {info.args[1].shape};
    s.rows.push_back({{Shard(0)}, {Shard(0), Shard(0), Shard(0)}});
    s.rows.push_back({{kSum}, {kSum, kRep, kRep}});
    s.rows.push_back({{kAvg}, {kAvg, kRep, kRep}});
    return s;
  });
}

}  // namespace quilt::rules
