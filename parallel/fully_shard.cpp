// FSDP2 units: see fully_shard.h.
//
// Layout of one unit over a shard axis of W ranks. Parameter p (its TP-local full tensor),
// seen as (outer_p, len_p, inner_p) around its shard dim d_p (outer: the dims before d_p,
// inner: those after), is cut torch.chunk-wise into W ranges of len_p; rank k's piece
// (outer_p, n_k, inner_p) lies contiguous in its segment, which leaves room for
// pad_p = ceil(len_p / W) of them, so each rank's segment of the unit has the same size
// F = sum_p outer_p * pad_p * inner_p and one all-gather of F elements per rank rebuilds all:
//
//   gathered (W * F):  [ rank 0: p0 piece | p1 piece | ... ][ rank 1: p0 piece | ... ] ...
//   sharded  (F):      this rank's segment (master dtype); each sharded parameter is a view
//   full (sum numel_p): the gathered parameters, each a view, freed after use
//
// With d_p = 0 (outer 1) the rank-major pieces are the full parameter's own rows; with d_p = 1
// each piece is a strided block (every one of the outer rows holds n_k of its len_p), so the
// gather's unpacking copies it into a narrow() of the full view along d_p. The reduce-scatter
// runs the same layout backwards: each rank's block of the full gradient copied into (W * F),
// padding zero, reduce-scattered (avg) into F, each parameter's part a view.
#include "parallel/fully_shard.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "collectives/communicator.h"
#include "dtensor/dist_spec.h"
#include "dtensor/dtensor.h"
#include "dtensor/sharding.h"
#include "engine/autograd.h"
#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"
#include "engine/trace.h"

namespace quilt {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

bool ends_with_name(const std::string& name, const std::string& suffix) {
  if (name == suffix) return true;
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         name[name.size() - suffix.size() - 1] == '.';
}

// The mesh a sharded parameter lives on when it is already a DTensor on `tp`: the tp axes
// first, then the FSDP axes, because FSDP cuts the TP-local shard (placements cut in mesh-axis
// order). Built by splitting the root communicator both meshes come from; cached.
DeviceMesh combined_mesh(const DeviceMesh& fsdp, const DeviceMesh& tp) {
  const std::vector<int>& fr = fsdp.ranks();
  const std::vector<int>& tr = tp.ranks();
  const int me = fr[size_t(fsdp.rank())];
  QUILT_CHECK(tr[size_t(tp.rank())] == me && fsdp.root_comm() == tp.root_comm(),
              "[fully_shard] the tensor-parallel mesh ", tp.str(), " and the FSDP mesh ", fsdp.str(),
              " must be cut from one mesh");
  // Cached per root communicator (which a weak handle checks is still the same one: a freed
  // communicator's address may come back for a new group).
  struct Entry {
    std::weak_ptr<Communicator> root;
    DeviceMesh mesh;
  };
  static std::mutex mu;
  static std::map<std::tuple<const Communicator*, std::vector<int>, std::vector<int>>, Entry> cache;
  const std::shared_ptr<Communicator> root = fsdp.root_comm();
  auto key = std::make_tuple(root.get(), fr, tr);
  {
    std::lock_guard lk(mu);
    std::erase_if(cache, [](const auto& kv) { return kv.second.root.expired(); });  // groups gone
    if (auto it = cache.find(key); it != cache.end() && it->second.root.lock() == root) return it->second.mesh;
  }
  // Ranks of one row-major mesh add up along its axes: the group of (fsdp x tp) positions
  // through this rank is {f + t - me}. Its smallest rank names it.
  int color = INT32_MAX;
  std::set<int> members;
  for (int f : fr)
    for (int t : tr) {
      members.insert(f + t - me);
      color = std::min(color, f + t - me);
    }
  QUILT_CHECK(color >= 0 && members.size() == fr.size() * tr.size(),
              "[fully_shard] the FSDP mesh ", fsdp.str(), " and the tensor-parallel mesh ", tp.str(),
              " are not two axes of one mesh");
  const int key_rank = int(tp.rank()) * int(fr.size()) + fsdp.rank();  // tp major
  std::shared_ptr<Communicator> comm = root->split(color, key_rank);
  Shape shape = tp.shape();
  std::vector<std::string> names = tp.axis_names();
  for (int64_t a = 0; a < fsdp.ndim(); ++a) {
    shape.push_back(fsdp.size(a));
    names.push_back(fsdp.axis_names()[size_t(a)]);
  }
  DeviceMesh m(comm, shape, names);
  std::lock_guard lk(mu);
  cache[key] = Entry{root, m};
  return m;
}

}  // namespace

// One unit: its parameters, buffers and state.
class FSDPUnit : public std::enable_shared_from_this<FSDPUnit> {
 public:
  struct Param {
    std::vector<std::pair<Module*, std::string>> slots;  // every slot holding it (tied weights)
    std::string name;
    Tensor sharded;    // the leaf the optimizer sees (distributed)
    Tensor unsharded;  // the leaf compute uses (plain, or a DTensor on the TP mesh)
    Shape full_shape;   // TP-local full shape
    Shape shard_shape;  // this rank's piece: full_shape with dim cut to rank_len[me]
    std::shared_ptr<const DistSpec> tp_spec;  // the parameter's own layout before FSDP, if distributed
    std::shared_ptr<const DistSpec> sharded_spec;
    int64_t dim = 0;                          // the dim cut over the shard axis
    int64_t outer = 1, len = 1, inner = 1;    // full_shape seen as (outer, len, inner) around dim
    int64_t pad = 0;                          // ceil(len / W): the room every rank's segment keeps
    std::vector<int64_t> rank_len, rank_start;  // rank k's piece: [rank_start[k], +rank_len[k]) of dim
    int64_t seg_offset = 0, full_offset = 0;
    int64_t numel() const { return outer * len * inner; }
    // Rank k's piece inside the flat segment buffer `seg` whose rank k segment starts at `base`.
    Tensor piece_in(const Tensor& seg, int64_t base, int64_t k) const {
      const int64_t n = rank_len[size_t(k)];
      return seg.narrow(0, base + seg_offset, outer * n * inner).view({outer, n, inner});
    }
    // Rank k's piece of the full tensor seen as (outer, len, inner): a strided view when outer > 1.
    Tensor piece_of(const Tensor& full3, int64_t k) const {
      return full3.narrow(1, rank_start[size_t(k)], rank_len[size_t(k)]);
    }
    bool requires_grad = false;
  };
  enum class State { sharded, gathering, unsharded };

  FSDPUnit(Module& module, const DeviceMesh& mesh, const FSDPPolicy& policy, const std::string& label)
      : module_(&module), mesh_(mesh), policy_(policy), label_(label) {}

  void build(const std::set<const TensorImpl*>& skip);
  int64_t shard_dim_of(const std::string& name, const Tensor& param) const;
  void install_hooks();

  // ---- state machine ----
  void issue_unshard();
  void wait_unshard();
  void install(bool unsharded);
  void reshard(bool after_forward);
  void pre_forward(std::vector<Tensor>& inputs);
  void post_forward(std::vector<Tensor>& outputs);
  void pre_backward();
  void on_grad_ready();
  void launch_reduce(bool fill_missing);
  void finish();

  std::vector<FSDPUnit*> subtree() {
    std::vector<FSDPUnit*> all{this};
    for (auto& c : children_)
      for (FSDPUnit* u : c->subtree()) all.push_back(u);
    return all;
  }

  Module* module_;
  DeviceMesh mesh_;
  FSDPPolicy policy_;
  std::string label_;
  FSDPUnit* parent_ = nullptr;
  std::vector<std::shared_ptr<FSDPUnit>> children_;
  std::vector<Param> params_;
  std::shared_ptr<Communicator> shard_comm_, replicate_comm_, group_comm_;
  int64_t world_ = 1, me_ = 0, segment_ = 0, full_numel_ = 0, group_ = 0;
  DType master_dtype_ = DType::f32, compute_dtype_ = DType::f32, reduce_dtype_ = DType::f32;
  Tensor sharded_flat_;  // (F) master dtype
  Tensor full_flat_;     // (sum rows * row) compute dtype; storage freed while sharded
  Tensor gather_buf_, kept_;
  Work gather_work_;
  bool gather_from_kept_ = false;
  State state_ = State::sharded;
  bool sync_ = true;
  bool backward_started_ = false;
  size_t grads_ready_ = 0, grad_params_ = 0;
  struct Pending {
    Work work;      // the reduce-scatter, then (HSDP) the all-reduce over the replicas
    Tensor out, in;
    bool replicated = false;  // the all-reduce has been issued
  };
  std::vector<Pending> pending_;
  // The root's record of the newest reduce-scatter of any unit below it: the next one waits
  // for it first, so one reduce-scatter input (a unit's full gradients) is alive at a time
  // beyond the one being filled, not every unit's until finish().
  struct InFlight {
    FSDPUnit* unit = nullptr;
    size_t index = 0;
  };
  InFlight inflight_;
  FSDPUnit* root() {
    FSDPUnit* u = this;
    while (u->parent_) u = u->parent_;
    return u;
  }
  FSDPUnitStats stats_;
};

void FSDPUnit::build(const std::set<const TensorImpl*>& skip) {
  const int64_t nd = mesh_.ndim();
  QUILT_CHECK(nd == 1 || nd == 2, "[fully_shard] ", label_, ": the mesh must be 1-D (shard) or 2-D (replicate, shard), got ",
              mesh_.str());
  shard_comm_ = mesh_.comm_ptr(nd - 1);
  if (nd == 2) replicate_comm_ = mesh_.comm_ptr(0);
  world_ = shard_comm_->size();
  me_ = shard_comm_->rank();
  if (const int64_t* n = std::get_if<int64_t>(&policy_.reshard_after_forward)) {
    QUILT_CHECK(*n >= 1 && world_ % *n == 0, "[fully_shard] ", label_, ": reshard_after_forward=", *n,
                " must divide the shard axis size ", world_);
    group_ = *n;
    group_comm_ = shard_comm_->split(int(me_ / *n), int(me_));
  }
  // Every slot of each parameter (tied ones share a tensor).
  std::map<const TensorImpl*, size_t> index;
  for (auto& [path, m] : module_->named_modules()) {
    for (auto& [local, t] : m->named_parameters("", /*recurse=*/false)) {
      if (!t.defined() || skip.count(t.unsafe_impl())) continue;
      auto it = index.find(t.unsafe_impl());
      if (it != index.end()) {
        params_[it->second].slots.emplace_back(m, local);
        continue;
      }
      index.emplace(t.unsafe_impl(), params_.size());
      Param p;
      p.slots.emplace_back(m, local);
      p.name = t.name().empty() ? (path.empty() ? local : path + "." + local) : t.name();
      p.sharded = t;  // the full tensor for now
      params_.push_back(std::move(p));
    }
  }
  if (params_.empty()) return;
  master_dtype_ = params_[0].sharded.dtype();
  compute_dtype_ = policy_.param_dtype.value_or(master_dtype_);
  reduce_dtype_ = policy_.reduce_dtype.value_or(compute_dtype_);
  for (Param& p : params_) {
    const Tensor& t = p.sharded;
    QUILT_CHECK(t.dtype() == master_dtype_, "[fully_shard] ", label_, ": parameter '", p.name, "' is ",
                dtype_name(t.dtype()), " but '", params_[0].name, "' is ", dtype_name(master_dtype_),
                " (one unit holds one dtype)");
    QUILT_CHECK(t.dim() >= 1, "[fully_shard] ", label_, ": parameter '", p.name, "' is 0-dimensional");
    if (t.is_distributed()) p.tp_spec = t.dist_spec();
    const Tensor local = t.local();
    p.full_shape = local.shape();
    p.dim = shard_dim_of(p.name, t);
    for (int64_t d = 0; d < int64_t(p.full_shape.size()); ++d) {
      const int64_t n = p.full_shape[size_t(d)];
      if (d < p.dim) p.outer *= n;
      else if (d == p.dim) p.len = n;
      else p.inner *= n;
    }
    p.rank_len = chunk_sizes(p.len, world_);
    for (int64_t k = 0, s = 0; k < world_; ++k) {
      p.rank_start.push_back(s);
      s += p.rank_len[size_t(k)];
    }
    p.shard_shape = p.full_shape;
    p.shard_shape[size_t(p.dim)] = p.rank_len[size_t(me_)];
    p.pad = (p.len + world_ - 1) / world_;
    p.seg_offset = segment_;
    segment_ += p.outer * p.pad * p.inner;
    p.full_offset = full_numel_;
    full_numel_ += p.numel();
    p.requires_grad = t.requires_grad();
  }
  NoGradGuard ng;
  sharded_flat_ = zeros({segment_}, {.dtype = master_dtype_, .device = params_[0].sharded.device()});
  // The gathered parameters' buffer starts without memory: it is allocated per gather.
  full_flat_ = Tensor::from_storage(Storage::allocate(0, sharded_flat_.device()), {full_numel_}, {1}, 0, compute_dtype_);
  for (Param& p : params_) {
    const Tensor local = p.sharded.local();
    const int64_t my_len = p.rank_len[size_t(me_)];
    Tensor view = sharded_flat_.narrow(0, p.seg_offset, numel_of(p.shard_shape)).view(p.shard_shape);
    // A parameter built under DeferredInitGuard has no values yet: init_weights fills the shard.
    if (my_len > 0 && !is_deferred(p.sharded)) view.copy_(local.narrow(p.dim, p.rank_start[size_t(me_)], my_len));
    // The sharded leaf: a DTensor on the FSDP mesh (or on tp axes + FSDP axes).
    DeviceMesh pm = mesh_;
    Placements pl;
    if (p.tp_spec) {
      pm = combined_mesh(mesh_, p.tp_spec->mesh);
      pl = p.tp_spec->placements;
    }
    if (nd == 2) pl.push_back(Replicate());
    pl.push_back(Shard(p.dim));
    p.sharded_spec = std::make_shared<const DistSpec>(pm, pl, p.sharded.shape());
    QUILT_CHECK(p.sharded_spec->local_shape() == p.shard_shape, "[fully_shard] ", label_, ": internal layout of '",
                p.name, "' disagrees with its DTensor spec: ", p.sharded_spec->str());
    Tensor sharded = Tensor::make_distributed(view, p.sharded_spec, p.sharded.shape());
    sharded.set_name(p.name);
    if (p.requires_grad) sharded.set_requires_grad(true);
    // The unsharded leaf: a view of full_flat_, whose storage is freed while sharded.
    Tensor full_view = full_flat_.narrow(0, p.full_offset, p.numel()).view(p.full_shape);
    Tensor unsharded = p.tp_spec ? Tensor::make_distributed(full_view, p.tp_spec, p.sharded.shape()) : full_view;
    unsharded.set_name(p.name);
    if (p.requires_grad) unsharded.set_requires_grad(true);
    p.sharded = sharded;
    p.unsharded = unsharded;
    if (p.requires_grad) ++grad_params_;
  }
  install(false);
}

// The policy's choice, else dim 0 unless that leaves ranks empty and dim 1 does not (see
// FSDPPolicy::shard_dim). Shapes are the TP-local ones: FSDP cuts what this rank holds.
int64_t FSDPUnit::shard_dim_of(const std::string& name, const Tensor& param) const {
  const Shape shape = param.local().shape();
  const int64_t nd = int64_t(shape.size());
  if (policy_.shard_dim) {
    if (const std::optional<int64_t> d = policy_.shard_dim(name, param)) {
      QUILT_CHECK(*d >= -nd && *d < nd, "[fully_shard] ", label_, ": shard_dim ", *d, " for parameter '", name,
                  "' of shape ", shape, " is out of range");
      return *d < 0 ? *d + nd : *d;
    }
  }
  return nd >= 2 && shape[0] < world_ && shape[1] >= world_ ? 1 : 0;
}

void FSDPUnit::install(bool unsharded) {
  for (Param& p : params_)
    for (auto& [m, slot] : p.slots) m->replace_parameter(slot, unsharded ? p.unsharded : p.sharded);
}

void FSDPUnit::issue_unshard() {
  if (state_ != State::sharded || params_.empty()) return;
  NoGradGuard ng;
  trace::Scope scope;
  if (trace::enabled()) scope.begin("fsdp", "fsdp all_gather " + label_);
  scope.arg("bytes", world_ * segment_ * int64_t(dtype_size(compute_dtype_)));
  ++stats_.all_gathers;
  gather_buf_ = empty({world_ * segment_}, {.dtype = compute_dtype_, .device = sharded_flat_.device()});
  if (gather_from_kept_) {
    gather_work_ = group_comm_->all_gather(gather_buf_, kept_, /*async_op=*/true);
    stats_.all_gather_seqs.push_back(group_comm_->last_seq());
  } else {
    const Tensor src = compute_dtype_ == master_dtype_ ? sharded_flat_ : cast(sharded_flat_, compute_dtype_);
    gather_work_ = shard_comm_->all_gather(gather_buf_, src, /*async_op=*/true);
    stats_.all_gather_seqs.push_back(shard_comm_->last_seq());
  }
  state_ = State::gathering;
}

void FSDPUnit::wait_unshard() {
  if (params_.empty() || state_ == State::unsharded) return;
  if (state_ == State::sharded) issue_unshard();
  NoGradGuard ng;
  trace::Scope scope;
  if (trace::enabled()) scope.begin("fsdp", "fsdp all_gather wait " + label_);
  const auto t0 = Clock::now();
  gather_work_.wait();
  stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  gather_work_ = Work();
  if (full_flat_.storage().nbytes() == 0) full_flat_.storage().resize_(size_t(full_numel_) * dtype_size(compute_dtype_));
  for (Param& p : params_) {
    const Tensor full = full_flat_.narrow(0, p.full_offset, p.numel()).view({p.outer, p.len, p.inner});
    for (int64_t k = 0; k < world_; ++k)
      if (p.rank_len[size_t(k)] > 0) p.piece_of(full, k).copy_(p.piece_in(gather_buf_, k * segment_, k));
  }
  if (group_ > 0 && !gather_from_kept_) {
    // Keep this rank's part of the gather for groups of group_ ranks: member j of a group
    // holds segments [j * W / N, (j + 1) * W / N), so the group's all-gather rebuilds all W.
    const int64_t per = world_ / group_;
    kept_ = gather_buf_.narrow(0, (me_ % group_) * per * segment_, per * segment_).clone();
  }
  gather_buf_ = Tensor();
  state_ = State::unsharded;
}

void FSDPUnit::reshard(bool after_forward) {
  if (params_.empty() || state_ == State::sharded) return;
  if (state_ == State::gathering) wait_unshard();
  install(false);
  full_flat_.storage().resize_(0);
  gather_from_kept_ = after_forward && group_ > 0;
  if (!gather_from_kept_) kept_ = Tensor();
  state_ = State::sharded;
}

void FSDPUnit::pre_forward(std::vector<Tensor>& inputs) {
  wait_unshard();
  install(true);
  backward_started_ = false;
  grads_ready_ = 0;
  // Prefetch: the next unit in forward order, and the first unit nested in this one.
  if (parent_) {
    auto& sib = parent_->children_;
    for (size_t i = 0; i + 1 < sib.size(); ++i)
      if (sib[i].get() == this) sib[i + 1]->issue_unshard();
  }
  if (!children_.empty()) children_.front()->issue_unshard();
  if (policy_.cast_forward_inputs && policy_.param_dtype)
    for (Tensor& x : inputs)
      if (x.defined() && is_floating(x.dtype()) && x.dtype() != *policy_.param_dtype) x = cast(x, *policy_.param_dtype);
}

void FSDPUnit::post_forward(std::vector<Tensor>& outputs) {
  if (policy_.output_dtype)
    for (Tensor& y : outputs)
      if (y.defined() && is_floating(y.dtype()) && y.dtype() != *policy_.output_dtype) y = cast(y, *policy_.output_dtype);
  if (!grad_enabled()) {  // no backward follows: free everything now
    reshard(false);
    return;
  }
  // The root keeps its parameters: backward needs them at once.
  const bool* flag = std::get_if<bool>(&policy_.reshard_after_forward);
  if (parent_ && !(flag && !*flag)) reshard(/*after_forward=*/true);
  std::weak_ptr<FSDPUnit> self = weak_from_this();
  for (Tensor& y : outputs)
    if (y.defined() && y.requires_grad())
      y.register_hook([self](const Tensor&) -> Tensor {
        if (auto u = self.lock()) u->pre_backward();
        return {};
      });
}

void FSDPUnit::pre_backward() {
  if (backward_started_) return;
  backward_started_ = true;
  wait_unshard();
  install(true);
  // Prefetch: the unit before this one in forward order, and the last unit nested in this one.
  if (parent_) {
    auto& sib = parent_->children_;
    for (size_t i = 1; i < sib.size(); ++i)
      if (sib[i].get() == this) sib[i - 1]->issue_unshard();
  }
  if (!children_.empty()) children_.back()->issue_unshard();
}

void FSDPUnit::on_grad_ready() {
  if (++grads_ready_ < grad_params_) return;
  grads_ready_ = 0;
  if (sync_) launch_reduce(false);
  reshard(false);
}

void FSDPUnit::launch_reduce(bool fill_missing) {
  NoGradGuard ng;
  bool any = false;
  for (Param& p : params_) any = any || (p.requires_grad && p.unsharded.grad().defined());
  if (!any) return;
  Tensor in = zeros({world_ * segment_}, {.dtype = reduce_dtype_, .device = sharded_flat_.device()});
  for (Param& p : params_) {
    if (!p.requires_grad) continue;
    Tensor g = p.unsharded.grad();
    if (!g.defined()) {
      QUILT_CHECK(fill_missing, "[fully_shard] internal: '", p.name, "' has no gradient");
      continue;  // zeros
    }
    const Tensor gl = g.local().reshape({p.outer, p.len, p.inner});
    for (int64_t k = 0; k < world_; ++k)
      if (p.rank_len[size_t(k)] > 0) p.piece_in(in, k * segment_, k).copy_(p.piece_of(gl, k));
    p.unsharded.set_grad(Tensor());
  }
  Tensor out = empty({segment_}, {.dtype = reduce_dtype_, .device = sharded_flat_.device()});
  // The previous unit's reduce-scatter had this unit's whole backward to finish.
  // HSDP: its all-reduce over the replicas follows at once, overlapping this unit's own.
  FSDPUnit* r = root();
  if (r->inflight_.unit) {
    FSDPUnit* u = r->inflight_.unit;
    Pending& prev = u->pending_[r->inflight_.index];
    prev.work.wait();
    prev.in = Tensor();
    if (u->replicate_comm_ && u->replicate_comm_->size() > 1) {
      prev.work = u->replicate_comm_->all_reduce(prev.out, ReduceOp::avg, /*async_op=*/true);
      prev.replicated = true;
    }
  }
  ++stats_.reduce_scatters;
  trace::Scope scope;
  if (trace::enabled()) scope.begin("fsdp", "fsdp reduce_scatter " + label_);
  scope.arg("bytes", in.numel() * int64_t(dtype_size(in.dtype())));
  Work w = shard_comm_->reduce_scatter(out, in, ReduceOp::avg, /*async_op=*/true);
  pending_.push_back({std::move(w), out, in});
  r->inflight_ = {this, pending_.size() - 1};
}

void FSDPUnit::finish() {
  NoGradGuard ng;
  backward_started_ = false;  // the next backward (a pipeline's next micro-batch) gathers again
  if (sync_) launch_reduce(true);  // gradients that arrived for only some parameters
  reshard(false);  // a root after a forward without backward, or a unit some gradients missed
  for (Pending& pd : pending_) {
    if (pd.replicated) continue;
    pd.work.wait();
    pd.in = Tensor();
    if (replicate_comm_ && replicate_comm_->size() > 1) {
      pd.work = replicate_comm_->all_reduce(pd.out, ReduceOp::avg, true);
      pd.replicated = true;
    }
  }
  for (Pending& pd : pending_) {
    pd.work.wait();
    for (Param& p : params_) {
      if (!p.requires_grad) continue;
      Tensor part = pd.out.narrow(0, p.seg_offset, numel_of(p.shard_shape)).view(p.shard_shape);
      if (part.dtype() != master_dtype_) part = part.to(master_dtype_);
      if (policy_.gradient_divide_factor) {
        // The reductions averaged over every rank of the mesh; the caller's divisor replaces that.
        const double ranks = double(world_) * double(replicate_comm_ ? replicate_comm_->size() : 1);
        part = part * (ranks / *policy_.gradient_divide_factor);
      }
      Tensor cur = p.sharded.grad();
      if (cur.defined()) cur.local().add_(part);
      else p.sharded.set_grad(Tensor::make_distributed(part.contiguous(), p.sharded_spec, p.sharded.shape()));
    }
  }
  pending_.clear();
  FSDPUnit* r = root();
  if (r->inflight_.unit == this) r->inflight_ = {};
}

void FSDPUnit::install_hooks() {
  // The module's hooks own the unit (it lives as long as the module); everything else that
  // refers back to it (gradient hooks on its own tensors) holds it weakly.
  std::shared_ptr<FSDPUnit> owner = shared_from_this();
  module_->register_forward_pre_hook([owner](Module&, std::vector<Tensor>& inputs) { owner->pre_forward(inputs); });
  module_->register_forward_hook(
      [owner](Module&, const std::vector<Tensor>&, std::vector<Tensor>& outputs) { owner->post_forward(outputs); });
  std::weak_ptr<FSDPUnit> self = weak_from_this();
  for (Param& p : params_)
    if (p.requires_grad)
      p.unsharded.register_post_accumulate_grad_hook([self](Tensor&) {
        if (auto u = self.lock()) u->on_grad_ready();
      });
}

namespace {

// Units by module, so a later fully_shard finds the units below it. Ranks of the threads
// backend are threads with their own modules, hence one map for all and a lock.
std::mutex g_units_mu;
std::map<const Module*, std::weak_ptr<FSDPUnit>>& units_by_module() {
  static std::map<const Module*, std::weak_ptr<FSDPUnit>> m;
  return m;
}

std::shared_ptr<FSDPUnit> unit_of(const Module* m) {
  std::lock_guard lk(g_units_mu);
  auto it = units_by_module().find(m);
  return it == units_by_module().end() ? nullptr : it->second.lock();
}

// The units directly below `root` (not below another unit that is itself below root), in
// named_modules order, which is registration (forward) order.
std::vector<std::shared_ptr<FSDPUnit>> top_units_below(Module& root) {
  std::vector<std::shared_ptr<FSDPUnit>> found;
  std::vector<std::string> taken;  // paths of units found, to skip what lies below them
  for (auto& [path, m] : root.named_modules()) {
    if (m == &root) continue;
    bool inside = false;
    for (const std::string& t : taken) inside = inside || path.rfind(t + ".", 0) == 0;
    if (inside) continue;
    if (auto u = unit_of(m); u && !u->parent_) {
      found.push_back(u);
      taken.push_back(path);
    }
  }
  return found;
}

std::shared_ptr<FSDPUnit> make_unit(Module& module, const DeviceMesh& mesh, const FSDPPolicy& policy,
                                    const std::string& label) {
  QUILT_CHECK(!unit_of(&module), "[fully_shard] ", label, " is already an FSDP unit");
  auto unit = std::make_shared<FSDPUnit>(module, mesh, policy, label);
  unit->children_ = top_units_below(module);
  std::set<const TensorImpl*> skip;
  for (auto& c : unit->children_) {
    c->parent_ = unit.get();
    for (FSDPUnit* u : c->subtree())
      for (auto& p : u->params_) {
        skip.insert(p.sharded.unsafe_impl());
        skip.insert(p.unsharded.unsafe_impl());
      }
  }
  for (const std::string& name : policy.ignored_params) {
    QUILT_CHECK(module.has_parameter(name), "[fully_shard] ignored parameter '", name, "' is not a parameter of ", label);
    skip.insert(module.parameter(name).unsafe_impl());
  }
  // Ignored parameters nested in children were skipped there already.
  unit->build(skip);
  unit->install_hooks();
  std::lock_guard lk(g_units_mu);
  auto& m = units_by_module();
  for (auto it = m.begin(); it != m.end();) it = it->second.expired() ? m.erase(it) : std::next(it);
  m[&module] = unit;
  return unit;
}

}  // namespace
}  // namespace detail

std::shared_ptr<FSDPModule> fully_shard(Module& module, const DeviceMesh& mesh, const FSDPPolicy& policy) {
  QUILT_CHECK(mesh.defined(), "[fully_shard] needs a mesh");
  // FP32 islands first: each module whose name ends with one of the suffixes is a unit of its
  // own, gathering and reducing in f32 and handing its outputs back in the compute dtype.
  if (!policy.fp32_modules.empty()) {
    FSDPPolicy island = policy;
    island.param_dtype = DType::f32;
    island.reduce_dtype = DType::f32;
    island.output_dtype = policy.param_dtype;
    island.fp32_modules.clear();
    island.ignored_params.clear();
    std::vector<std::string> units;  // paths of units already made under `module`: their modules are theirs
    for (auto& [path, m] : module.named_modules()) {
      if (m == &module) continue;
      bool inside = false;
      for (const std::string& u : units) inside = inside || path.rfind(u + ".", 0) == 0;
      if (inside) continue;
      if (detail::unit_of(m)) {
        units.push_back(path);
        continue;
      }
      bool match = false;
      for (const std::string& s : policy.fp32_modules) match = match || detail::ends_with_name(path, s);
      if (match && !m->named_parameters().empty()) {
        detail::make_unit(*m, mesh, island, path);
        units.push_back(path);
      }
    }
  }
  return std::make_shared<FSDPModule>(detail::make_unit(module, mesh, policy, module.type_name()));
}

void FSDPModule::set_requires_gradient_sync(bool sync) {
  for (detail::FSDPUnit* u : unit_->subtree()) u->sync_ = sync;
}

void FSDPModule::finish_backward() {
  for (detail::FSDPUnit* u : unit_->subtree()) u->finish();
}

void FSDPModule::unshard() {
  for (detail::FSDPUnit* u : unit_->subtree()) u->issue_unshard();
  for (detail::FSDPUnit* u : unit_->subtree()) {
    u->wait_unshard();
    u->install(true);
  }
}

void FSDPModule::reshard() {
  for (detail::FSDPUnit* u : unit_->subtree()) u->reshard(false);
}

std::vector<FSDPUnitStats> FSDPModule::stats() const {
  std::vector<FSDPUnitStats> s;
  for (detail::FSDPUnit* u : unit_->subtree()) s.push_back(u->stats_);
  return s;
}

double FSDPModule::all_gather_wait_seconds() const {
  double t = 0;
  for (detail::FSDPUnit* u : unit_->subtree()) t += u->stats_.wait_seconds;
  return t;
}

size_t FSDPModule::num_units() const { return unit_->subtree().size(); }

std::vector<std::string> FSDPModule::param_names() const {
  std::vector<std::string> n;
  for (const auto& p : unit_->params_) n.push_back(p.name);
  return n;
}

DType FSDPModule::param_dtype() const { return unit_->compute_dtype_; }

}  // namespace quilt
