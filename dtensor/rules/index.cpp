// Sharding rules of indexing, joining and ordering ops (gather, scatter_add, index_select,
// index_add, cat, sort, topk). Each works along one dim, which is needed whole (positions along
// it are global); the other dims stay sharded where every operand has them at full size.
// Selections (gather, index_select) pass every Partial through; the adding ops are linear in
// (x, src) together. cumsum has no rule and takes the replicated fallback.
#include "dtensor/rules/rules.h"

namespace quilt::rules {
namespace {

const ReduceOp kAllOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

// Rows sharding every dim but `dim` of all inputs and outputs alike.
std::vector<Row> rows_except(int64_t ndim, int64_t dim, size_t n_out, size_t n_in) {
  std::vector<Row> rows;
  for (int64_t d = 0; d < ndim; ++d)
    if (d != dim) rows.push_back(uniform_row(n_out, n_in, Shard(d)));
  return rows;
}

}  // namespace

void register_index_rules(Registry& r) {
  // gather(x, index) along dim: out[..i..] = x[..index[..i..]..] — a row of the output reads the
  // same row of x, so a dim may be cut when x and index have it at one size.
  r.add("gather", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& x = info.args[0].shape;
    const Shape& idx = info.args[1].shape;
    if (x.empty() || idx.size() != x.size()) return std::nullopt;
    const int64_t dim = info.attr<int64_t>("dim");
    Strategy s;
    s.out_shapes = {idx};
    for (int64_t e = 0; e < int64_t(x.size()); ++e)
      if (e != dim && x[size_t(e)] == idx[size_t(e)]) s.rows.push_back(uniform_row(1, 2, Shard(e)));
    for (ReduceOp op : kAllOps) s.rows.push_back({{Partial(op)}, {Partial(op), Replicate()}});
    return s;
  });
  // scatter_add(x, index, src): x plus src added at the indexed positions — rows as gather's,
  // and linear in (x, src): (x1 + x2) + scatter(s1 + s2) = (x1 + scatter(s1)) + (x2 + scatter(s2)).
  r.add("scatter_add", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& x = info.args[0].shape;
    const Shape& idx = info.args[1].shape;
    if (x.empty() || idx.size() != x.size()) return std::nullopt;
    const int64_t dim = info.attr<int64_t>("dim");
    Strategy s;
    s.out_shapes = {x};
    for (int64_t e = 0; e < int64_t(x.size()); ++e)
      if (e != dim && x[size_t(e)] == idx[size_t(e)]) s.rows.push_back(uniform_row(1, 3, Shard(e)));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg})
      s.rows.push_back({{Partial(op)}, {Partial(op), Replicate(), Partial(op)}});
    return s;
  });
  // index_select(x, index) along dim: other dims keep their shards; a cut index picks a cut of
  // the output's dim from a whole x.
  r.add("index_select", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& x = info.args[0].shape;
    if (x.empty() || info.args[1].shape.size() > 1) return std::nullopt;
    const int64_t dim = info.attr<int64_t>("dim");
    Strategy s;
    Shape out = x;
    out[size_t(dim)] = numel_of(info.args[1].shape);
    s.out_shapes = {out};
    for (int64_t e = 0; e < int64_t(x.size()); ++e)
      if (e != dim) s.rows.push_back({{Shard(e)}, {Shard(e), Replicate()}});
    if (info.args[1].shape.size() == 1) s.rows.push_back({{Shard(dim)}, {Replicate(), Shard(0)}});
    for (ReduceOp op : kAllOps) s.rows.push_back({{Partial(op)}, {Partial(op), Replicate()}});
    return s;
  });
  // index_add(x, index, src): src's slices added at the indexed positions of dim; linear in (x, src).
  r.add("index_add", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& x = info.args[0].shape;
    if (x.empty()) return std::nullopt;
    const int64_t dim = info.attr<int64_t>("dim");
    Strategy s;
    s.out_shapes = {x};
    for (int64_t e = 0; e < int64_t(x.size()); ++e)
      if (e != dim) s.rows.push_back({{Shard(e)}, {Shard(e), Replicate(), Shard(e)}});
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg})
      s.rows.push_back({{Partial(op)}, {Partial(op), Replicate(), Partial(op)}});
    return s;
  });

  // cat places its inputs side by side along `dim`: the other dims are cut alike on every
  // input (they have equal sizes there), and a cat of Partial pieces is the Partial of the cat.
  r.add("cat", [](const OpInfo& info) -> std::optional<Strategy> {
    if (!info.has_attr("dim") || info.args.empty()) return std::nullopt;
    const int64_t dim = info.attr<int64_t>("dim");
    Shape out = info.args[0].shape;
    out[size_t(dim)] = 0;
    for (const ArgInfo& a : info.args) out[size_t(dim)] += a.shape[size_t(dim)];
    Strategy s;
    s.out_shapes = {out};
    s.rows = rows_except(int64_t(out.size()), dim, 1, info.args.size());
    for (ReduceOp op : kAllOps) s.rows.push_back(uniform_row(1, info.args.size(), Partial(op)));
    return s;
  });
  // sort / topk along `dim` -> (values, indices): rows along the other dims are independent.
  for (const char* name : {"sort", "topk"}) {
    r.add(name, [](const OpInfo& info) -> std::optional<Strategy> {
      if (!info.has_attr("dim") || !info.has_attr("k")) return std::nullopt;
      Shape out = info.args[0].shape;
      if (out.empty()) return std::nullopt;
      const int64_t dim = info.attr<int64_t>("dim");
      out[size_t(dim)] = info.attr<int64_t>("k");
      Strategy s;
      s.out_shapes = {out, out};
      s.rows = rows_except(int64_t(out.size()), dim, 2, 1);
      return s;
    });
  }
}

}  // namespace quilt::rules
