// Sharding rules of elementwise ops (unary, binary, where, copies/casts, full_like).
// Every pointwise op keeps any Shard(d) of its output, with each input sharded on its
// broadcast-aligned dim (or Replicate where it broadcasts); the tables below add the Partial
// rows each op's algebra allows. Partial(sum) inputs of non-linear ops get no row, so the
// dispatcher reduces them (to Replicate) first.
#include "dtensor/rules/rules.h"

namespace quilt::rules {
namespace {

const Placement kSum = Partial(ReduceOp::sum);
const Placement kAvg = Partial(ReduceOp::avg);
const Placement kMax = Partial(ReduceOp::max);
const Placement kMin = Partial(ReduceOp::min);
const Placement kRep = Replicate();

Strategy pointwise(const OpInfo& info, std::vector<Row> partial_rows) {
  Strategy s;
  const Shape out = broadcast_all(info);
  s.out_shapes = {out};
  s.rows = pointwise_shard_rows(info, out);
  for (Row& r : partial_rows) s.rows.push_back(std::move(r));
  return s;
}

void unary(Registry& r, const char* name, std::vector<Row> partial_rows) {
  r.add(name, [rows = std::move(partial_rows)](const OpInfo& info) -> std::optional<Strategy> {
    return pointwise(info, rows);
  });
}

void binary(Registry& r, const char* name, std::vector<Row> partial_rows) {
  r.add(name, [rows = std::move(partial_rows)](const OpInfo& info) -> std::optional<Strategy> {
    return pointwise(info, rows);
  });
}

bool dtype_named(const OpInfo& info, DType* out) {
  if (!info.has_attr("dtype")) return false;
  const std::string& n = info.attr<std::string>("dtype");
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64, DType::i32, DType::i64, DType::b8})
    if (n == dtype_name(t)) { *out = t; return true; }
  return false;
}

}  // namespace

void register_pointwise_rules(Registry& r) {
  // neg is linear: -(A1 + A2) = -A1 + -A2 (and the mean of negations is the negated mean);
  // it turns a maximum into a minimum: -max(A_i) = min(-A_i).
  unary(r, "neg", {{{kSum}, {kSum}}, {{kAvg}, {kAvg}}, {{kMin}, {kMax}}, {{kMax}, {kMin}}});
  // Non-decreasing functions commute with max and min: f(max A_i) = max f(A_i).
  for (const char* name : {"exp", "tanh", "sigmoid", "relu", "sign"})
    unary(r, name, {{{kMax}, {kMax}}, {{kMin}, {kMin}}});
  // Non-linear, non-monotone (or defined on part of the line only: log, sqrt, rsqrt of a
  // Partial piece may leave the domain): Partial inputs are reduced first.
  for (const char* name :
       {"log", "sqrt", "rsqrt", "silu", "gelu", "abs", "sin", "cos", "square", "logical_not", "gelu_grad"})
    unary(r, name, {});

  // (A1 + A2) +- (B1 + B2) = (A1 +- B1) + (A2 +- B2); means likewise. max(A_i) + B = max(A_i + B),
  // and B - max(A_i) = min(B - A_i).
  binary(r, "add", {{{kSum}, {kSum, kSum}}, {{kAvg}, {kAvg, kAvg}},
                    {{kMax}, {kMax, kRep}}, {{kMax}, {kRep, kMax}}, {{kMin}, {kMin, kRep}}, {{kMin}, {kRep, kMin}}});
  binary(r, "sub", {{{kSum}, {kSum, kSum}}, {{kAvg}, {kAvg, kAvg}},
                    {{kMax}, {kMax, kRep}}, {{kMin}, {kRep, kMax}}, {{kMin}, {kMin, kRep}}, {{kMax}, {kRep, kMin}}});
  // Multiplication by a replicated tensor is linear: (A1 + A2) * B = A1 * B + A2 * B.
  binary(r, "mul", {{{kSum}, {kSum, kRep}}, {{kSum}, {kRep, kSum}}, {{kAvg}, {kAvg, kRep}}, {{kAvg}, {kRep, kAvg}}});
  // Division by a replicated tensor is multiplication by its inverse: linear in the numerator.
  binary(r, "div", {{{kSum}, {kSum, kRep}}, {{kAvg}, {kAvg, kRep}}});
  // max(max A_i, max B_i) = max_i max(A_i, B_i), and max(max A_i, B) = max_i max(A_i, B).
  binary(r, "maximum", {{{kMax}, {kMax, kMax}}, {{kMax}, {kMax, kRep}}, {{kMax}, {kRep, kMax}}});
  binary(r, "minimum", {{{kMin}, {kMin, kMin}}, {{kMin}, {kMin, kRep}}, {{kMin}, {kRep, kMin}}});
  // pow, comparisons and logic are non-linear: Partial inputs are reduced first.
  for (const char* name : {"pow", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or"}) binary(r, name, {});

  // where(C, A1 + A2, B1 + B2) = where(C, A1, B1) + where(C, A2, B2): it picks elementwise, so
  // it is linear in the picked values for a fixed (replicated) condition; max and min alike.
  r.add("where", [](const OpInfo& info) -> std::optional<Strategy> {
    return pointwise(info, {{{kSum}, {kRep, kSum, kSum}},
                            {{kAvg}, {kRep, kAvg, kAvg}},
                            {{kMax}, {kRep, kMax, kMax}},
                            {{kMin}, {kRep, kMin, kMin}}});
  });

  // Copies keep every placement; a cast keeps sums and means only between floating dtypes
  // (a rounding cast of a sum is not the sum of the casts for integers), and keeps max/min when
  // it is monotone (any cast but the one to bool).
  for (const char* name : {"contiguous", "clone", "to", "cast"}) {
    r.add(name, [](const OpInfo& info) -> std::optional<Strategy> {
      DType to = info.args[0].dtype;
      dtype_named(info, &to);
      const DType from = info.args[0].dtype;
      std::vector<Row> rows;
      if (from == to || (is_floating(from) && is_floating(to))) {
        rows.push_back({{kSum}, {kSum}});
        rows.push_back({{kAvg}, {kAvg}});
      }
      if (to != DType::b8 || from == DType::b8) {
        rows.push_back({{kMax}, {kMax}});
        rows.push_back({{kMin}, {kMin}});
      }
      return pointwise(info, rows);
    });
  }

  // full_like reads only its input's shape: a Partial input (whose pieces all have the full
  // shape) gives a Replicate output with no communication.
  r.add("full_like", [](const OpInfo& info) -> std::optional<Strategy> {
    return pointwise(info, {{{kRep}, {kSum}}, {{kRep}, {kAvg}}, {{kRep}, {kMax}}, {{kRep}, {kMin}}});
  });
}

}  // namespace quilt::rules
