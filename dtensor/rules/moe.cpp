// Sharding rules of the mixture-of-experts ops (engine/ops/moe.h). The group offsets and the
// routing order are global row positions, so the row dims (M, tokens) stay whole and the
// integer inputs Replicate; what may be cut is the hidden dim (K of grouped_mm, H of the row
// ops) and N, as in tensor-parallel experts. moe_route has no row beyond the all-Replicate one
// (a counting sort over every token).
#include <string>

#include "dtensor/rules/rules.h"

namespace quilt::rules {
namespace {

const Placement R = Replicate();

// Linear in input `i` alone (the others replicated): (A1 + A2) B = A1 B + A2 B, sum and avg.
void add_linear_rows(std::vector<Row>& rows, size_t n_in, size_t i) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
    Row r{{Partial(op)}, std::vector<Placement>(n_in, R)};
    r.in[i] = Partial(op);
    rows.push_back(std::move(r));
  }
}

}  // namespace

void register_moe_rules(Registry& r) {
  // grouped_mm(x (M, K), w (E, K, N), offsets (E)) -> (M, N): per row, mk,kn->mn with the group's w.
  r.add("grouped_mm", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape &x = info.args[0].shape, &w = info.args[1].shape;
    if (x.size() != 2 || w.size() != 3) return std::nullopt;
    Strategy s;
    s.out_shapes = {{x[0], w[2]}};
    s.rows = {
        // Column-parallel experts: each rank's column block of every w_e gives that block of out.
        {{Shard(1)}, {R, Shard(2), R}},
        // Row-parallel: a K-slice of x times the same K-slice of w_e is a partial sum over K.
        {{Partial()}, {Shard(1), Shard(1), R}},
    };
    add_linear_rows(s.rows, 3, 0);
    add_linear_rows(s.rows, 3, 1);
    return s;
  });
  // grouped_mm_weight_grad(x (M, K), dy (M, N), offsets) -> dw (E, K, N), dw_e = x_e^T dy_e.
  r.add("grouped_mm_weight_grad", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape &x = info.args[0].shape, &dy = info.args[1].shape, &off = info.args[2].shape;
    if (x.size() != 2 || dy.size() != 2 || off.size() != 1) return std::nullopt;
    Strategy s;
    s.out_shapes = {{off[0], x[1], dy[1]}};
    s.rows = {
        {{Shard(1)}, {Shard(1), R, R}},  // a column block of x gives that row block of each dw_e
        {{Shard(2)}, {R, Shard(1), R}},  // a column block of dy gives that column block of each dw_e
    };
    add_linear_rows(s.rows, 3, 0);
    add_linear_rows(s.rows, 3, 1);
    return s;
  });
  // moe_permute(x (T, H), order, w?) -> (T*k, H) and moe_unpermute(y (T*k, H), order, w?) -> (T, H)
  // move (and weight) whole rows: columns are independent, so H may be cut; linear in x (or y)
  // and, separately, in w.
  for (const char* name : {"moe_permute", "moe_unpermute"}) {
    const bool permute = std::string(name) == "moe_permute";
    r.add(name, [permute](const OpInfo& info) -> std::optional<Strategy> {
      const Shape& x = info.args[0].shape;
      if (x.size() != 2 || !info.has_attr("k")) return std::nullopt;
      const int64_t k = info.attr<int64_t>("k");
      Strategy s;
      s.out_shapes = {{permute ? x[0] * k : x[0] / k, x[1]}};
      s.rows = {{{Shard(1)}, {Shard(1), R, R}}};
      add_linear_rows(s.rows, 3, 0);
      if (info.args[2].defined) add_linear_rows(s.rows, 3, 2);
      return s;
    });
  }
  // moe_slot_dot(a (T, H), b (T*k, H), order) -> (T, k): dots over H, so cutting H on both sides
  // leaves partial sums; bilinear, so linear in each side alone.
  r.add("moe_slot_dot", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& a = info.args[0].shape;
    if (a.size() != 2 || !info.has_attr("k")) return std::nullopt;
    Strategy s;
    s.out_shapes = {{a[0], info.attr<int64_t>("k")}};
    s.rows = {{{Partial()}, {Shard(1), Shard(1), R}}};
    add_linear_rows(s.rows, 3, 0);
    add_linear_rows(s.rows, 3, 1);
    return s;
  });
  // moe_route(expert_idx (T, k)) -> order (T*k), counts (E), offsets (E): all replicated.
  r.add("moe_route", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& idx = info.args[0].shape;
    if (idx.size() != 2 || !info.has_attr("num_experts")) return std::nullopt;
    const int64_t e = info.attr<int64_t>("num_experts");
    Strategy s;
    s.out_shapes = {{numel_of(idx)}, {e}, {e}};
    return s;
  });
}

}  // namespace quilt::rules
