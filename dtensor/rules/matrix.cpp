// Sharding rules of matrix products, generated from einsum strings: matmul of (..., m, k) and
// (..., k, n) is "<batch>mk,<batch>kn-><batch>mn" with the batch dims aligned at the right
// (NumPy broadcasting), e.g. "mk,kn->mn" or "abmk,bkn->abmn".
#include <algorithm>

#include "dtensor/rules/rules.h"

namespace quilt::rules {

void register_matrix_rules(Registry& r) {
  // Rows come from einsum_rows: a kept letter shards the output (m: row-parallel,
  // n: column-parallel, batch letters: data-parallel); the contracted k gives Partial(sum);
  // and a Partial operand times a replicated one stays Partial (linear in each argument).
  r.add("matmul", [](const OpInfo& info) -> std::optional<Strategy> {
    const Shape& a = info.args[0].shape;
    const Shape& b = info.args[1].shape;
    if (a.size() < 2 || b.size() < 2) return std::nullopt;
    const size_t batch = std::max(a.size(), b.size()) - 2;
    const std::string letters = "abcdefghij";
    if (batch > letters.size()) return std::nullopt;
    const std::string all = letters.substr(0, batch);
    const std::string ba = all.substr(batch - (a.size() - 2)), bb = all.substr(batch - (b.size() - 2));
    Strategy s;
    Shape out = broadcast_shapes(Shape(a.begin(), a.end() - 2), Shape(b.begin(), b.end() - 2), "matmul");
    out.push_back(a[a.size() - 2]);
    out.push_back(b.back());
    s.out_shapes = {out};
    s.rows = einsum_rows(ba + "mk," + bb + "kn->" + all + "mn", info);
    return s;
  });
}

}  // namespace quilt::rules
