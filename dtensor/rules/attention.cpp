// Sharding rules of scaled dot-product attention and its backward. Each (batch, head) pair is an
// attention of its own, so q, k, v (and out, lse, dO, dlse) sharded alike along the batch dim
// (data parallel) or the head dim (tensor parallel) give outputs sharded the same way; document
// ids and positions (B, n) follow the batch and are needed whole for a head cut. Query head h reads kv head
// h / G, so a head cut must keep each rank's query heads with their kv heads: the ranks along the
// head dim must divide the kv heads, unless G = 1 (uneven cuts then split q and k alike).
#include "dtensor/rules/rules.h"

namespace quilt::rules {
namespace {

// q_arg: where q is among the inputs (k follows it); the last inputs are document ids and
// positions (two each) when the op has them; every other input and every output is (B, H, ...).
Strategy attention(const OpInfo& info, std::vector<Shape> out_shapes, size_t q_arg) {
  const int64_t hq = info.args[q_arg].shape[1], hkv = info.args[q_arg + 1].shape[1];
  const size_t n_in = info.args.size();
  const size_t docs = (info.attr<bool>("documents") ? 2 : 0) + (info.attr<bool>("positions") ? 2 : 0);
  Strategy s;
  s.out_shapes = std::move(out_shapes);
  for (int64_t d : {0, 1}) {
    Row r;
    r.out.assign(s.out_shapes.size(), Shard(d));
    r.in.assign(n_in, Shard(d));
    for (size_t i = n_in - docs; i < n_in; ++i) r.in[i] = d == 0 ? Placement(Shard(0)) : Placement(Replicate());
    s.rows.push_back(std::move(r));
  }
  if (hq != hkv)
    s.check = [hkv](const Shape& mesh_shape, const std::vector<Placements>&, const std::vector<Placements>& out) {
      int64_t ranks = 1;
      for (size_t a = 0; a < mesh_shape.size(); ++a)
        if (out[0][a].is_shard(1)) ranks *= mesh_shape[a];
      return hkv % ranks == 0;
    };
  return s;
}

}  // namespace

void register_attention_rules(Registry& r) {
  // (q, k, v, [q_doc, k_doc], [q_pos, k_pos]) -> (out (B, Hq, T, Dv), lse (B, Hq, T)).
  r.add("scaled_dot_product_attention", [](const OpInfo& info) -> std::optional<Strategy> {
    Shape out = info.args[0].shape, lse = out;
    out[3] = info.args[2].shape[3];
    lse.pop_back();
    return attention(info, {out, lse}, 0);
  });
  // (dO, dlse, q, k, v, out, lse, [q_doc, k_doc], [q_pos, k_pos]) -> (dq, dk, dv).
  r.add("scaled_dot_product_attention_backward", [](const OpInfo& info) -> std::optional<Strategy> {
    return attention(info, {info.args[2].shape, info.args[3].shape, info.args[4].shape}, 2);
  });
}

}  // namespace quilt::rules
