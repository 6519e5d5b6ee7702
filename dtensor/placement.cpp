// Placement printing and parsing (checkpoint metadata stores placements as text).
#include "dtensor/placement.h"

#include <cctype>

#include "engine/tensor.h"

namespace quilt {

std::string Placement::str() const {
  switch (kind_) {
    case Kind::replicate: return "R";
    case Kind::shard: return "S(" + std::to_string(dim_) + ")";
    case Kind::partial: return std::string("P(") + reduce_op_name(reduce_) + ")";
  }
  return "?";
}

std::string str(const Placements& placements) {
  std::string s = "(";
  for (size_t i = 0; i < placements.size(); ++i) s += (i ? ", " : "") + placements[i].str();
  return s + ")";
}

namespace {
std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}
}  // namespace

Placement parse_placement(const std::string& text) {
  const std::string t = trim(text);
  if (t == "R") return Replicate();
  if (t.size() >= 4 && t[1] == '(' && t.back() == ')') {
    const std::string inner = t.substr(2, t.size() - 3);
    if (t[0] == 'S') {
      try {
        size_t used = 0;
        const long long d = std::stoll(inner, &used);
        if (used == inner.size()) return Shard(d);
      } catch (const std::exception&) {
      }
    } else if (t[0] == 'P') {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min})
        if (inner == reduce_op_name(op)) return Partial(op);
    }
  }
  fail("[placement] cannot parse '", text, "' (expected R, S(<dim>) or P(sum|avg|max|min))");
}

Placements parse_placements(const std::string& text) {
  std::string t = trim(text);
  QUILT_CHECK(t.size() >= 2 && t.front() == '(' && t.back() == ')', "[placement] cannot parse '", text,
              "' (expected a parenthesised list such as (S(0), R))");
  t = t.substr(1, t.size() - 2);
  Placements out;
  if (trim(t).empty()) return out;
  // Commas inside S(..)/P(..) never occur, so a plain split is enough.
  size_t start = 0;
  while (true) {
    const size_t c = t.find(',', start);
    out.push_back(parse_placement(t.substr(start, c == std::string::npos ? std::string::npos : c - start)));
    if (c == std::string::npos) break;
    start = c + 1;
  }
  return out;
}

Placements normalize_placements(const Placements& placements, int64_t ndim, const char* op) {
  Placements out = placements;
  for (Placement& p : out) {
    if (!p.is_shard()) continue;
    const int64_t d = p.dim();
    QUILT_CHECK(d >= -ndim && d < ndim, "[", op, "] Shard(", d, ") is out of range for a tensor of ", ndim, " dims");
    p = Shard(d < 0 ? d + ndim : d);
  }
  return out;
}

Placements replicated(size_t mesh_ndim) { return Placements(mesh_ndim, Replicate()); }

bool partials_compatible(const Placements& placements) {
  int family = -1;  // 0: sum/avg, 1: max, 2: min
  for (const Placement& x : placements) {
    if (!x.is_partial()) continue;
    const int f = x.reduce_op() == ReduceOp::max ? 1 : x.reduce_op() == ReduceOp::min ? 2 : 0;
    if (family >= 0 && family != f) return false;
    family = f;
  }
  return true;
}

std::vector<Placements> all_placements(size_t mesh_ndim, int64_t tensor_ndim) {
  std::vector<Placement> options{Replicate(), Partial(ReduceOp::sum), Partial(ReduceOp::avg), Partial(ReduceOp::max),
                                 Partial(ReduceOp::min)};
  for (int64_t d = 0; d < tensor_ndim; ++d) options.push_back(Shard(d));
  std::vector<Placements> out{{}};
  for (size_t a = 0; a < mesh_ndim; ++a) {
    std::vector<Placements> next;
    for (const Placements& p : out)
      for (const Placement& x : options) {
        Placements q = p;
        q.push_back(x);
        if (partials_compatible(q)) next.push_back(q);
      }
    out = std::move(next);
  }
  return out;
}

}  // namespace quilt
