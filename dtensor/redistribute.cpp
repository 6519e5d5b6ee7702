// The transition table (source, target) -> collective for one mesh axis, the planner that
// orders single-axis steps for n-D meshes, and the plan cache.
#include "dtensor/redistribute.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>
#include <queue>
#include <set>

#include "dtensor/sharding.h"
#include "engine/autograd.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"

namespace quilt {
namespace {

// ---- what a single step may do ----------------------------------------------------------

// True when some axis after `axis` shards tensor dim `dim` (then `axis` is not innermost for it).
bool sharded_after(const Placements& p, int64_t axis, int64_t dim) {
  for (size_t b = size_t(axis) + 1; b < p.size(); ++b)
    if (p[b].is_shard(dim)) return true;
  return false;
}

// Whether axis `a` may go from cur[a] to `to` in one step.
bool direct_step(const Placements& cur, int64_t a, const Placement& to) {
  const Placement& from = cur[size_t(a)];
  if (from == to) return false;
  if (from.is_shard() && sharded_after(cur, a, from.dim())) return false;
  if (to.is_shard() && sharded_after(cur, a, to.dim())) return false;
  if (from.is_partial() && to.is_partial()) return false;                        // via R
  if (from.is_shard() && to.is_partial()) return to.is_partial(ReduceOp::sum);  // zero padding
  return true;
}

// Bytes moved per rank by one step, as a multiple of the global tensor's bytes.
double step_cost(const Placements& cur, const Shape& mesh_shape, int64_t a, const Placement& to) {
  const double k = double(mesh_shape[size_t(a)]);
  if (k == 1) return 0;
  double frac = 1;  // the local shard's share of the global tensor
  for (size_t b = 0; b < cur.size(); ++b)
    if (cur[b].is_shard()) frac /= double(mesh_shape[b]);
  const Placement& from = cur[size_t(a)];
  if (from.is_shard() && to.is_replicate()) return frac * (k - 1);          // all_gather
  if (from.is_shard() && to.is_shard()) return frac * (k - 1) / k;         // all_to_all
  if (from.is_partial() && to.is_replicate()) return 2 * frac * (k - 1) / k;  // all_reduce
  if (from.is_partial() && to.is_shard()) return frac * (k - 1) / k;       // reduce_scatter
  return 0;                                                                // local
}

// ---- planner --------------------------------------------------------------------------

std::string plan_key(const Shape& mesh_shape, const Placements& src, const Placements& dst) {
  return detail::concat(mesh_shape, str(src), "->", str(dst));
}

RedistributePlan search(const Shape& mesh_shape, const Placements& src, const Placements& dst) {
  const size_t n = src.size();
  // Candidate placements per axis: the source's, the target's, and Replicate (the hub every
  // transition can pass through).
  std::vector<std::vector<Placement>> cand(n);
  for (size_t a = 0; a < n; ++a) {
    for (const Placement& p : {src[a], dst[a], Placement(Replicate())})
      if (std::find(cand[a].begin(), cand[a].end(), p) == cand[a].end()) cand[a].push_back(p);
  }
  struct Entry {
    double cost;
    size_t steps;
    Placements state;
    bool operator>(const Entry& o) const {
      if (cost != o.cost) return cost > o.cost;
      if (steps != o.steps) return steps > o.steps;
      return o.state < state;  // deterministic order on ties (the same plan on every rank)
    }
  };
  std::map<Placements, std::pair<double, size_t>> best;
  std::map<Placements, std::pair<Placements, RedistributeStep>> parent;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
  best[src] = {0, 0};
  queue.push({0, 0, src});
  while (!queue.empty()) {
    Entry e = queue.top();
    queue.pop();
    auto bi = best.find(e.state);
    if (bi != best.end() && (bi->second.first < e.cost || (bi->second.first == e.cost && bi->second.second < e.steps)))
      continue;
    if (e.state == dst) break;
    for (size_t a = 0; a < n; ++a) {
      for (const Placement& to : cand[a]) {
        if (!direct_step(e.state, int64_t(a), to)) continue;
        Placements next = e.state;
        next[a] = to;
        if (!partials_compatible(next)) continue;
        const double c = e.cost + step_cost(e.state, mesh_shape, int64_t(a), to);
        const size_t s = e.steps + 1;
        auto it = best.find(next);
        const double eps = 1e-12;
        if (it != best.end() && (it->second.first < c - eps || (std::abs(it->second.first - c) <= eps && it->second.second <= s)))
          continue;
        best[next] = {c, s};
        parent[next] = {e.state, RedistributeStep{int64_t(a), e.state[a], to}};
        queue.push({c, s, next});
      }
    }
  }
  QUILT_CHECK(best.count(dst), "[redistribute] no way from ", str(src), " to ", str(dst), " on a mesh of shape ",
              mesh_shape);
  RedistributePlan plan;
  plan.cost = best[dst].first;
  for (Placements s = dst; s != src;) {
    const auto& [prev, step] = parent.at(s);
    plan.steps.push_back(step);
    s = prev;
  }
  std::reverse(plan.steps.begin(), plan.steps.end());
  return plan;
}

struct PlanCache {
  std::mutex mu;
  std::map<std::string, RedistributePlan> plans;  // node-based: references stay valid
};

PlanCache& plan_cache() {
  static PlanCache c;
  return c;
}

// ---- executing one step on the local shard ------------------------------------------------

Tensor dim_to_front(const Tensor& t, int64_t d) {
  if (d == 0) return contiguous(t);
  Shape perm{d};
  for (int64_t i = 0; i < t.dim(); ++i)
    if (i != d) perm.push_back(i);
  return contiguous(permute(t, perm));
}

Tensor dim_from_front(const Tensor& t, int64_t d) {
  if (d == 0) return t;
  Shape perm;
  for (int64_t i = 1; i <= d; ++i) perm.push_back(i);
  perm.push_back(0);
  for (int64_t i = d + 1; i < t.dim(); ++i) perm.push_back(i);
  return permute(t, perm);
}

Tensor fresh(const Tensor& t) { return clone(t); }

// S(d) -> R over `comm`: gathers the pieces `sizes` along d.
Tensor gather_dim(Communicator& comm, const Tensor& local, int64_t d, const std::vector<int64_t>& sizes) {
  Tensor in = dim_to_front(local, d);
  Shape out_shape = in.shape();
  out_shape[0] = std::accumulate(sizes.begin(), sizes.end(), int64_t(0));
  Tensor out = Tensor::empty(out_shape, {.dtype = local.dtype(), .device = local.device()});
  comm.all_gather_v(out, in, sizes);
  return dim_from_front(out, d);
}

// P -> S(d) over `comm`: reduces and keeps this rank's piece of `sizes` along d.
Tensor reduce_scatter_dim(Communicator& comm, const Tensor& local, int64_t d, const std::vector<int64_t>& sizes,
                          ReduceOp op) {
  Tensor in = dim_to_front(local, d);
  Shape out_shape = in.shape();
  out_shape[0] = sizes[size_t(comm.rank())];
  Tensor out = Tensor::empty(out_shape, {.dtype = local.dtype(), .device = local.device()});
  comm.reduce_scatter_v(out, in, sizes, op);
  return dim_from_front(out, d);
}

// S(i) -> S(j) over `comm`: rank r holds piece r of dim i (sizes si) and all of dim j; it ends
// with all of dim i and piece r of dim j (sizes sj). Buffers are flat so pieces of different
// shapes can travel in one all_to_all.
Tensor all_to_all_dims(Communicator& comm, const Tensor& local, int64_t i, int64_t j, const std::vector<int64_t>& si,
                       const std::vector<int64_t>& sj) {
  const int k = comm.size(), me = comm.rank();
  Tensor in = dim_to_front(local, j);  // (Lj, ...): the block for rank s is rows [off_s, off_s + sj[s])
  const Shape rest(in.shape().begin() + 1, in.shape().end());
  const int64_t row = numel_of(rest);
  const int64_t pi = i < j ? i + 1 : i;  // position of dim i inside `in`
  std::vector<int64_t> in_splits(static_cast<size_t>(k)), out_splits(static_cast<size_t>(k));
  for (int s = 0; s < k; ++s) {
    in_splits[size_t(s)] = sj[size_t(s)] * row;
    Shape rs = rest;
    rs[size_t(pi - 1)] = si[size_t(s)];
    out_splits[size_t(s)] = sj[size_t(me)] * numel_of(rs);
  }
  Tensor send = reshape(in, {in.numel()});
  const int64_t total = std::accumulate(out_splits.begin(), out_splits.end(), int64_t(0));
  Tensor recv = Tensor::empty({total}, {.dtype = local.dtype(), .device = local.device()});
  comm.all_to_all_single(recv, send, out_splits, in_splits);
  // Reassemble: block s has shape (sj[me], rest with dim i = si[s]); concatenate along dim i.
  Shape full = rest;
  full.insert(full.begin(), sj[size_t(me)]);
  full[size_t(pi)] = std::accumulate(si.begin(), si.end(), int64_t(0));
  Tensor out = Tensor::empty(full, {.dtype = local.dtype(), .device = local.device()});
  int64_t flat = 0, along = 0;
  for (int s = 0; s < k; ++s) {
    Shape bs = full;
    bs[size_t(pi)] = si[size_t(s)];
    const int64_t n = numel_of(bs);
    if (n > 0) out.narrow(pi, along, si[size_t(s)]).copy_(reshape(recv.narrow(0, flat, n), bs));
    flat += n;
    along += si[size_t(s)];
  }
  return dim_from_front(out, j);
}

// S(d) -> P(sum): the shard placed at its offset in zeros of the piece's size.
Tensor pad_to_piece(const Tensor& local, int64_t d, const Chunk& mine, int64_t piece_len) {
  Shape s = local.shape();
  s[size_t(d)] = piece_len;
  Tensor out = zeros(s, {.dtype = local.dtype(), .device = local.device()});
  if (mine.size > 0) out.narrow(d, mine.offset, mine.size).copy_(local);
  return out;
}

Tensor run_step(const Tensor& local, const Placements& cur, const RedistributeStep& st, const DistSpec& spec) {
  const DeviceMesh& mesh = spec.mesh;
  const int64_t a = st.axis;
  const int64_t k = mesh.size(a);
  const Shape& coord = mesh.coordinate();
  const Placement& from = st.from;
  const Placement& to = st.to;
  if (k == 1) return local;  // one coordinate: every placement holds the same bytes
  Communicator& comm = mesh.comm(a);
  const int64_t c = coord[size_t(a)];
  auto piece = [&](int64_t dim) { return piece_before_axis(spec.shape, mesh.shape(), cur, coord, a, dim); };

  if (from.is_shard() && to.is_replicate()) return gather_dim(comm, local, from.dim(), chunk_sizes(piece(from.dim()).size, k));
  if (from.is_shard() && to.is_shard())
    return all_to_all_dims(comm, local, from.dim(), to.dim(), chunk_sizes(piece(from.dim()).size, k),
                           chunk_sizes(piece(to.dim()).size, k));
  if (from.is_shard() && to.is_partial()) {
    const int64_t len = piece(from.dim()).size;
    return pad_to_piece(local, from.dim(), chunk_of(len, k, c), len);
  }
  if (from.is_replicate() && to.is_shard()) {
    const Chunk ch = chunk_of(local.size(to.dim()), k, c);
    return fresh(local.narrow(to.dim(), ch.offset, ch.size));
  }
  if (from.is_replicate() && to.is_partial()) {
    if (to.is_partial(ReduceOp::sum) && c != 0) return zeros_like(local);
    return fresh(local);
  }
  if (from.is_partial() && to.is_replicate()) {
    Tensor t = fresh(local);
    comm.all_reduce(t, from.reduce_op());
    return t;
  }
  if (from.is_partial() && to.is_shard())
    return reduce_scatter_dim(comm, local, to.dim(), chunk_sizes(piece(to.dim()).size, k), from.reduce_op());
  fail("[redistribute] no direct transition ", from.str(), " -> ", to.str(), " on mesh axis ", a);
}

}  // namespace

std::string RedistributePlan::str() const {
  if (steps.empty()) return "no-op";
  std::string s;
  for (size_t i = 0; i < steps.size(); ++i)
    s += (i ? "; " : "") + detail::concat("axis ", steps[i].axis, ": ", steps[i].from.str(), " -> ", steps[i].to.str());
  return s;
}

const RedistributePlan& plan_redistribute(const Shape& mesh_shape, const Placements& src, const Placements& dst) {
  QUILT_CHECK(src.size() == mesh_shape.size() && dst.size() == mesh_shape.size(), "[redistribute] placements ",
              str(src), " -> ", str(dst), " for a mesh of shape ", mesh_shape);
  QUILT_CHECK(partials_compatible(dst) && partials_compatible(src), "[redistribute] ", str(src),
              " -> ", str(dst), ": placements mix Partial reductions that do not combine");
  PlanCache& cache = plan_cache();
  const std::string key = plan_key(mesh_shape, src, dst);
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.plans.find(key);
    if (it != cache.plans.end()) return it->second;
  }
  RedistributePlan plan = search(mesh_shape, src, dst);
  std::lock_guard<std::mutex> lock(cache.mu);
  return cache.plans.emplace(key, std::move(plan)).first->second;
}

size_t redistribute_plan_cache_size() {
  std::lock_guard<std::mutex> lock(plan_cache().mu);
  return plan_cache().plans.size();
}

Tensor redistribute_local(const Tensor& local, const DistSpec& src, const Placements& dst_in) {
  NoGradGuard ng;
  const Placements dst = normalize_placements(dst_in, int64_t(src.shape.size()), "redistribute");
  QUILT_CHECK(local.shape() == src.local_shape(), "[redistribute] local shard of shape ", local.shape(),
              " does not match ", src.str(), " (expected ", src.local_shape(), ")");
  const RedistributePlan& plan = plan_redistribute(src.mesh.shape(), src.placements, dst);
  Tensor t = local.detach();
  Placements cur = src.placements;
  for (const RedistributeStep& st : plan.steps) {
    t = run_step(t, cur, st, src);
    cur[size_t(st.axis)] = st.to;
  }
  if (plan.steps.empty() || t.is_same(local) || !t.is_contiguous() || t.storage().data() == local.storage().data())
    t = clone(t);
  return t;
}

}  // namespace quilt
