// Loss parallel cross entropy: the two distributed handlers, the layout test they share, the
// per-row statistics (the only thing that crosses the class axis) and the cache that hands the
// forward's log-sum-exp to the backward so that the backward needs no communication.
#include "dtensor/loss_parallel.h"

#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <unordered_map>

#include "dtensor/dispatch.h"
#include "dtensor/dtensor.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/index.h"
#include "engine/ops/reduce.h"
#include "engine/ops/unary.h"
#include "engine/ops/view.h"

namespace quilt::detail {
namespace {

// Both primitives see the logits as (N, C): rows are dim 0, classes dim 1.
constexpr int64_t kRowDim = 0;
constexpr int64_t kClassDim = 1;

DType compute_dtype(DType logits) { return logits == DType::f64 ? DType::f64 : DType::f32; }

// ---- the layout ----

struct Layout {
  DeviceMesh mesh;
  int64_t axis = -1;     // the mesh axis that shards the classes
  Placements rows;       // of every per-row tensor (targets, loss, g): Shard(0) where the logits' rows are
  int64_t classes = 0;   // C, global
  int64_t first = 0;     // this rank's first class
  int64_t row0 = 0;      // this rank's first row (for error messages)
};

// The placements of `t`, Replicate everywhere for a plain tensor.
Placements layout_of(const Tensor& t, size_t n_axes) {
  return t.is_distributed() ? t.dist_spec()->placements : replicated(n_axes);
}

// The loss parallel layout of (logits, target), or nullopt when it is not that case.
std::optional<Layout> loss_parallel_layout(const Tensor& logits, const Tensor& target) {
  if (!logits.defined() || !logits.is_distributed() || logits.dim() != 2) return std::nullopt;
  if (!target.defined() || target.dim() != 1) return std::nullopt;
  const DistSpec& s = *logits.dist_spec();
  Layout l{s.mesh, -1, Placements(s.placements.size(), Replicate()), logits.size(kClassDim), 0, 0};
  for (size_t a = 0; a < s.placements.size(); ++a) {
    const Placement& p = s.placements[a];
    const bool cuts = s.mesh.size(int64_t(a)) > 1;
    if (p.is_shard(kClassDim) && cuts) {
      if (l.axis >= 0) return std::nullopt;  // classes cut by two axes: not handled
      l.axis = int64_t(a);
    } else if (p.is_shard(kRowDim)) {
      l.rows[a] = Shard(kRowDim);
    } else if (!p.is_replicate() && !(p.is_shard(kClassDim) && !cuts)) {
      return std::nullopt;  // Partial logits: the rule table reduces them first
    }
  }
  if (l.axis < 0) return std::nullopt;
  if (target.is_distributed()) {
    for (const Placement& p : target.dist_spec()->placements)
      if (p.is_partial()) return std::nullopt;
    if (!target.dist_spec()->placements[size_t(l.axis)].is_replicate()) return std::nullopt;
  }
  const Shape offset = s.local_offset();
  l.row0 = offset[kRowDim];
  l.first = offset[kClassDim];
  return l;
}

// `t` (per-row: targets or g) as this rank's rows, i.e. in layout l.rows.
Tensor local_rows(const Tensor& t, const Layout& l) {
  return local_shard_for(t, layout_of(t, l.rows.size()), l.rows, l.mesh);
}

// ---- ignore_index ----

// The ignore index the engine's cross_entropy primitives carry as an attribute.
std::optional<int64_t> ignore_index_of(Primitive& p, const std::vector<int64_t>&, int64_t, DType) {
  const Attrs attrs = p.attrs();
  auto it = attrs.find("ignore_index");
  QUILT_CHECK(it != attrs.end(), "[loss_parallel] ", p.name(), " carries no ignore_index attribute");
  return std::get<int64_t>(it->second);
}

std::vector<int64_t> host_targets(const Tensor& t) {
  const std::vector<double> v = t.to_vector();
  return std::vector<int64_t>(v.begin(), v.end());
}

// Throws as the engine's op does, naming the first bad target and its global row.
void check_targets(const std::vector<int64_t>& targets, const Layout& l, std::optional<int64_t> ignore) {
  for (size_t i = 0; i < targets.size(); ++i) {
    const int64_t t = targets[i];
    if (ignore && t == *ignore) continue;
    if (t < 0 || t >= l.classes) {
      const std::string valid =
          ignore ? "or ignore_index " + std::to_string(*ignore) : std::string("or the ignore_index");
      fail("[cross_entropy] target ", t, " at row ", l.row0 + int64_t(i), " is out of range for ", l.classes,
           " classes (valid: 0 to ", l.classes - 1, ", ", valid, ")");
    }
  }
}

// True for rows whose target counts (bool, (n)).
Tensor counted_rows(const Tensor& t64, std::optional<int64_t> ignore) {
  if (!ignore) return ones(t64.shape(), {.dtype = DType::b8, .device = t64.device()});
  return ne(t64, scalar_like(double(*ignore), t64));
}

// ---- per-row statistics ----

struct RowStats {
  Tensor max;            // (n) global max of each row
  Tensor sumexp;         // (n) global sum of exp(x - max)
  Tensor target_logit;   // (n) the target's logit (0 for targets outside [0, C))
};

// The statistics of this rank's rows over all classes: two all-reduces over the class axis.
// x: (n, c) this rank's block in the compute dtype; t64: (n) its targets.
RowStats row_stats(const Tensor& x, const Tensor& t64, const Layout& l) {
  const int64_t n = x.size(0), c = x.size(1);
  const TensorOptions opts{.dtype = x.dtype(), .device = x.device()};
  Communicator& comm = l.mesh.comm(l.axis);
  RowStats s;
  // An empty class slice (more ranks than some piece of C) contributes -inf, 0 and 0.
  s.max = (n > 0 && c > 0) ? contiguous(max(x, {kClassDim})) : full({n}, -INFINITY, opts);
  comm.all_reduce(s.max, ReduceOp::max);
  Tensor both;  // (2, n): sum of exp(x - max), target logit
  if (n > 0 && c > 0) {
    const Tensor sumexp = sum(exp(x - unsqueeze(s.max, 1)), {kClassDim});
    const Tensor mine = logical_and(ge(t64, scalar_like(double(l.first), t64)),
                                    lt(t64, scalar_like(double(l.first + c), t64)));
    const Tensor zero_idx = zeros({}, {.dtype = DType::i64, .device = x.device()});
    const Tensor idx = where(mine, t64 - scalar_like(double(l.first), t64), zero_idx);
    const Tensor picked = squeeze(gather(x, kClassDim, unsqueeze(idx, 1)), 1);
    both = stack({sumexp, where(mine, picked, zeros({}, opts))}, 0);
  } else {
    both = zeros({2, n}, opts);
  }
  comm.all_reduce(both, ReduceOp::sum);
  s.sumexp = both.select(0, 0);
  s.target_logit = both.select(0, 1);
  return s;
}

Tensor log_sum_exp(const RowStats& s) { return log(s.sumexp) + s.max; }

// ---- forward -> backward ----

// The forward's log-sum-exp per row, keyed by the local shard of the logits it was computed
// from: the primitive saves the logits (a handle sharing that shard), so the backward finds it
// there. Entries die with their shard (pruned on the next insert).
struct Saved {
  std::weak_ptr<TensorImpl> shard;
  Tensor lse;  // (n) compute dtype
  std::optional<int64_t> ignore;
};
struct SavedCache {
  std::mutex mu;
  std::unordered_map<const TensorImpl*, Saved> map;
};
SavedCache& saved_cache() {
  static SavedCache c;
  return c;
}

void save_stats(const Tensor& shard, Tensor lse, std::optional<int64_t> ignore) {
  SavedCache& c = saved_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto it = c.map.begin(); it != c.map.end();) it = it->second.shard.expired() ? c.map.erase(it) : std::next(it);
  c.map[shard.unsafe_impl()] = Saved{shard.impl_ptr(), std::move(lse), ignore};
}

std::optional<Saved> find_stats(const Tensor& shard) {
  SavedCache& c = saved_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.map.find(shard.unsafe_impl());
  if (it == c.map.end() || it->second.shard.lock() != shard.impl_ptr()) return std::nullopt;
  if (it->second.lse.size(0) != shard.size(0)) return std::nullopt;
  return it->second;
}

Tensor wrap(const Tensor& local, const Layout& l, const Placements& placements, const Shape& shape) {
  return Tensor::make_distributed(local, std::make_shared<const DistSpec>(l.mesh, placements, shape), shape);
}

}  // namespace

std::optional<std::vector<Tensor>> loss_parallel_cross_entropy(Primitive& p, const std::vector<Tensor>& inputs) {
  if (inputs.size() != 2) return std::nullopt;
  const Tensor& logits = inputs[0];
  std::optional<Layout> l = loss_parallel_layout(logits, inputs[1]);
  if (!l) return std::nullopt;
  // The graph is recorded (and the backward will want the statistics) only in this case.
  const bool will_backward = grad_enabled() && logits.requires_grad();

  NoGradGuard ng;
  const Tensor t = local_rows(inputs[1], *l);
  const std::vector<int64_t> targets = host_targets(t);
  const std::optional<int64_t> ignore = ignore_index_of(p, targets, l->classes, t.dtype());
  check_targets(targets, *l, ignore);

  const Tensor x_local = logits.local();
  const DType cd = compute_dtype(x_local.dtype());
  const Tensor x = x_local.dtype() == cd ? x_local : cast(x_local, cd);
  const Tensor t64 = cast(t, DType::i64);
  const RowStats s = row_stats(x, t64, *l);
  const Tensor lse = log_sum_exp(s);
  const Tensor zero = zeros({}, {.dtype = cd, .device = x.device()});
  const Tensor loss = contiguous(where(counted_rows(t64, ignore), lse - s.target_logit, zero));
  if (will_backward) save_stats(x_local, lse, ignore);
  return std::vector<Tensor>{wrap(loss, *l, l->rows, {logits.size(kRowDim)})};
}

std::optional<std::vector<Tensor>> loss_parallel_cross_entropy_backward(Primitive& p,
                                                                        const std::vector<Tensor>& inputs) {
  if (inputs.size() != 3 || !inputs[0].defined()) return std::nullopt;
  const Tensor& logits = inputs[1];
  std::optional<Layout> l = loss_parallel_layout(logits, inputs[2]);
  if (!l) return std::nullopt;
  const Tensor x_local = logits.local();
  std::optional<Saved> saved = find_stats(x_local);
  const Attrs attrs = p.attrs();
  const auto attr = attrs.find("ignore_index");
  // Without the forward's record the ignore index is only known from the attribute (probing
  // the backward op with out-of-range targets would index out of bounds).
  if (!saved && attr == attrs.end()) return std::nullopt;

  NoGradGuard ng;
  const DType cd = compute_dtype(x_local.dtype());
  const Tensor x = x_local.dtype() == cd ? x_local : cast(x_local, cd);
  const Tensor t64 = cast(local_rows(inputs[2], *l), DType::i64);
  const std::optional<int64_t> ignore = saved ? saved->ignore : std::optional<int64_t>(std::get<int64_t>(attr->second));
  // Recomputing the statistics costs the forward's two all-reduces.
  const Tensor lse = saved ? saved->lse : log_sum_exp(row_stats(x, t64, *l));
  const Tensor g = local_rows(inputs[0], *l);
  const Tensor gc = g.dtype() == cd ? g : cast(g, cd);

  const int64_t c = x.size(kClassDim);
  const Tensor classes = arange(double(l->first), double(l->first + c), 1, {.dtype = DType::i64, .device = x.device()});
  const Tensor onehot = cast(eq(unsqueeze(t64, 1), classes), cd);
  const Tensor gx = (exp(x - unsqueeze(lse, 1)) - onehot) * unsqueeze(gc, 1);
  // Ignored rows are written as zeros, never g * 0 (g is inf for a mean over no targets).
  const Tensor zero = zeros({}, {.dtype = cd, .device = x.device()});
  const Tensor kept = where(unsqueeze(counted_rows(t64, ignore), 1), gx, zero);
  const Tensor out = contiguous(kept.dtype() == x_local.dtype() ? kept : cast(kept, x_local.dtype()));
  return std::vector<Tensor>{wrap(out, *l, logits.dist_spec()->placements, logits.shape())};
}

}  // namespace quilt::detail
