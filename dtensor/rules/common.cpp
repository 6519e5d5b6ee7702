// Helpers shared by the rule tables: uniform rows, broadcasting and einsum-string expansion.
#include <algorithm>
#include <map>

#include "dtensor/rules/rules.h"

namespace quilt::rules {

Placement partial(ReduceOp op) { return Partial(op); }

Row uniform_row(size_t n_out, size_t n_in, const Placement& p) {
  return Row{std::vector<Placement>(n_out, p), std::vector<Placement>(n_in, p)};
}

Shape broadcast_all(const OpInfo& info) {
  Shape out;
  bool first = true;
  for (const ArgInfo& a : info.args) {
    if (!a.defined) continue;
    out = first ? a.shape : broadcast_shapes(out, a.shape, info.name.c_str());
    first = false;
  }
  return out;
}

std::vector<Row> pointwise_shard_rows(const OpInfo& info, const Shape& out_shape, size_t n_out) {
  std::vector<Row> rows;
  const int64_t nd = int64_t(out_shape.size());
  for (int64_t d = 0; d < nd; ++d) {
    Row r;
    r.out.assign(n_out, Shard(d));
    for (const ArgInfo& a : info.args) {
      if (!a.defined) { r.in.push_back(Replicate()); continue; }
      const int64_t id = d - (nd - int64_t(a.shape.size()));
      // An input without this dim, or broadcasting it from size 1, is needed whole.
      if (id < 0 || a.shape[size_t(id)] != out_shape[size_t(d)]) r.in.push_back(Replicate());
      else r.in.push_back(Shard(id));
    }
    rows.push_back(std::move(r));
  }
  return rows;
}

std::vector<Row> einsum_rows(const std::string& spec, const OpInfo& info) {
  const size_t arrow = spec.find("->");
  QUILT_CHECK(arrow != std::string::npos, "[dtensor] einsum spec '", spec, "' has no '->'");
  std::vector<std::string> ins;
  {
    const std::string lhs = spec.substr(0, arrow);
    size_t start = 0;
    while (true) {
      const size_t c = lhs.find(',', start);
      ins.push_back(lhs.substr(start, c == std::string::npos ? std::string::npos : c - start));
      if (c == std::string::npos) break;
      start = c + 1;
    }
  }
  const std::string out = spec.substr(arrow + 2);
  QUILT_CHECK(ins.size() == info.args.size(), "[dtensor] einsum spec '", spec, "' names ", ins.size(),
              " inputs; op '", info.name, "' has ", info.args.size());
  std::map<char, int64_t> size;  // the letter's full (non-broadcast) size
  for (size_t i = 0; i < ins.size(); ++i) {
    QUILT_CHECK(ins[i].size() == info.args[i].shape.size(), "[dtensor] einsum spec '", spec, "' gives input ", i, " ",
                ins[i].size(), " dims; it has shape ", info.args[i].shape);
    for (size_t p = 0; p < ins[i].size(); ++p) size[ins[i][p]] = std::max(size[ins[i][p]], info.args[i].shape[p]);
  }
  std::vector<Row> rows;
  std::string letters;
  for (const auto& [c, n] : size) letters += c;
  for (char c : letters) {
    const size_t po = out.find(c);
    Row r;
    // Kept letters shard the output; contracted ones leave each rank a partial sum of the
    // terms it holds: sum_k A[m,k] B[k,n] = sum over ranks of the sum over its k-slice.
    r.out.push_back(po != std::string::npos ? Placement(Shard(int64_t(po))) : Placement(Partial()));
    bool usable = true;
    for (size_t i = 0; i < ins.size(); ++i) {
      const size_t p = ins[i].find(c);
      if (p == std::string::npos) { r.in.push_back(Replicate()); continue; }
      if (info.args[i].shape[p] == size[c]) { r.in.push_back(Shard(int64_t(p))); continue; }
      // Broadcast from size 1: fine for a kept letter (the input is needed whole), not for a
      // contracted one (there is nothing to cut).
      if (po == std::string::npos) usable = false;
      r.in.push_back(Replicate());
    }
    if (usable) rows.push_back(std::move(r));
  }
  // Linear in each argument: (A1 + A2) B = A1 B + A2 B, for sum and for avg alike.
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
    for (size_t i = 0; i < ins.size(); ++i) {
      Row r;
      r.out.push_back(Partial(op));
      for (size_t j = 0; j < ins.size(); ++j) r.in.push_back(j == i ? Placement(Partial(op)) : Placement(Replicate()));
      rows.push_back(std::move(r));
    }
  }
  return rows;
}

}  // namespace quilt::rules
