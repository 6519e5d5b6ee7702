// Expert parallelism: see expert_parallel.h.
#include "parallel/expert_parallel.h"

#include <atomic>
#include <deque>
#include <numeric>

#include "dtensor/dtensor.h"
#include "engine/engine.h"
#include "engine/primitive.h"
#include "parallel/module_names.h"
#include "parallel/tensor_parallel.h"

namespace quilt {
namespace {

std::atomic<int64_t> g_dispatches{0}, g_sent{0}, g_received{0};

int64_t total(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

class AllToAllRows final : public AnyDevicePrimitive {
 public:
  AllToAllRows(std::shared_ptr<Communicator> comm, std::vector<int64_t> in, std::vector<int64_t> out)
      : comm_(std::move(comm)), in_(std::move(in)), out_(std::move(out)) {}
  const char* name() const override { return "all_to_all_rows"; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>& inputs) override {
    const Tensor x = inputs[0].contiguous();
    Shape shape = x.shape();
    shape[0] = total(out_);
    Tensor out = Tensor::empty(shape, {.dtype = x.dtype(), .device = x.device()});
    comm_->all_to_all_single(out, x, out_, in_);
    return {out};
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    // Each row goes back the way it came.
    return {all_to_all_rows(ctx.grads[0], comm_, out_, in_)};
  }

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<int64_t> in_, out_;
};

// What one dispatch decided, for its combine.
struct Route {
  std::vector<int64_t> in_splits, out_splits;  // rows to / from each ep rank
  Tensor back;  // (rows received) i64: source-major position of each expert-major row
};

// The dispatch and combine hooks of one experts module. Calls nest as pre, post, pre, post
// (an activation-checkpoint recomputation is one more such pair), so one pending route at a
// time; a deque keeps that true even if a hook were re-entered.
struct Dispatcher {
  std::shared_ptr<Communicator> comm;
  std::string name;
  int64_t experts = 0;  // global
  std::deque<Route> pending;

  void dispatch(std::vector<Tensor>& in) {
    QUILT_CHECK(in.size() == 2, "[expert parallel] ", name, " expects (rows, counts), got ", in.size(), " inputs");
    const Tensor x = in[0], counts = in[1];
    const int64_t ep = comm->size(), local = experts / ep;
    QUILT_CHECK(counts.dim() == 1 && counts.size(0) == experts, "[expert parallel] ", name, ": counts ",
                counts.shape(), " are not one per expert (", experts, ")");
    // Everyone learns how many rows each rank sends it for each of its experts.
    Tensor sent = counts.to(DType::i64).contiguous();
    Tensor recv = Tensor::empty({experts}, {.dtype = DType::i64, .device = sent.device()});
    {
      NoGradGuard ng;
      comm->all_to_all_single(recv, sent);
    }
    const std::vector<double> c = sent.to_vector(), r = recv.to_vector();  // r[s * local + j]: from s for my expert j
    Route route;
    route.in_splits.assign(size_t(ep), 0);
    route.out_splits.assign(size_t(ep), 0);
    for (int64_t s = 0; s < ep; ++s)
      for (int64_t j = 0; j < local; ++j) {
        route.in_splits[size_t(s)] += int64_t(c[size_t(s * local + j)]);
        route.out_splits[size_t(s)] += int64_t(r[size_t(s * local + j)]);
      }
    QUILT_CHECK(total(route.in_splits) == x.size(0), "[expert parallel] ", name, ": the counts add up to ",
                total(route.in_splits), " rows but ", x.size(0), " were given");
    Tensor got = all_to_all_rows(x, comm, route.in_splits, route.out_splits);
    // Received rows are source-major (s, then expert j); the experts want expert-major (j, then s).
    std::vector<double> order, local_counts(size_t(local), 0.0), back(size_t(got.size(0)));
    std::vector<int64_t> start(size_t(ep * local));
    for (int64_t s = 0, pos = 0; s < ep; ++s)
      for (int64_t j = 0; j < local; ++j) {
        start[size_t(s * local + j)] = pos;
        pos += int64_t(r[size_t(s * local + j)]);
      }
    order.reserve(size_t(got.size(0)));
    for (int64_t j = 0; j < local; ++j)
      for (int64_t s = 0; s < ep; ++s) {
        const int64_t n = int64_t(r[size_t(s * local + j)]);
        for (int64_t i = 0; i < n; ++i) {
          back[size_t(start[size_t(s * local + j)] + i)] = double(order.size());
          order.push_back(double(start[size_t(s * local + j)] + i));
        }
        local_counts[size_t(j)] += double(n);
      }
    // The reorder's indices and the local counts live where the rows do (a GPU's grouped GEMM
    // reads its offsets from device memory).
    const int64_t rows = got.size(0);
    const TensorOptions idx{.dtype = DType::i64, .device = x.device()};
    in[0] = local > 1 && ep > 1 ? index_select(got, 0, from_vector(order, {rows}, idx)) : got;
    in[1] = from_vector(local_counts, {local}, idx);
    route.back = from_vector(back, {rows}, idx);
    const int64_t me = comm->rank();
    g_dispatches.fetch_add(1);
    g_sent.fetch_add(total(route.in_splits) - route.in_splits[size_t(me)]);
    g_received.fetch_add(total(route.out_splits) - route.out_splits[size_t(me)]);
    pending.push_back(std::move(route));
  }

  void combine(std::vector<Tensor>& out) {
    QUILT_CHECK(!pending.empty(), "[expert parallel] ", name, ": a combine without its dispatch");
    Route route = std::move(pending.back());
    pending.pop_back();
    const int64_t ep = comm->size(), local = experts / ep;
    Tensor y = local > 1 && ep > 1 ? index_select(out[0], 0, route.back) : out[0];
    out[0] = all_to_all_rows(y, comm, route.out_splits, route.in_splits);
  }
};

}  // namespace

Tensor all_to_all_rows(const Tensor& x, const std::shared_ptr<Communicator>& comm, const std::vector<int64_t>& in_splits,
                       const std::vector<int64_t>& out_splits) {
  QUILT_CHECK(comm != nullptr, "[all_to_all_rows] needs a communicator");
  QUILT_CHECK(x.defined() && x.dim() >= 1 && !x.is_distributed(), "[all_to_all_rows] needs a plain tensor of rows");
  const size_t n = size_t(comm->size());
  QUILT_CHECK(in_splits.size() == n && out_splits.size() == n, "[all_to_all_rows] ", in_splits.size(), " in_splits and ",
              out_splits.size(), " out_splits for ", n, " ranks");
  QUILT_CHECK(total(in_splits) == x.size(0), "[all_to_all_rows] in_splits add up to ", total(in_splits), " rows, x has ",
              x.size(0), " (shape ", x.shape(), ")");
  return apply1(std::make_shared<AllToAllRows>(comm, in_splits, out_splits), {x});
}

void apply_ep(Module& root, const DeviceMesh& ep, const std::vector<std::string>& patterns) {
  QUILT_CHECK(ep.defined() && ep.ndim() == 1, "[apply_ep] needs a 1-D ep mesh");
  std::vector<std::pair<std::string, Module*>> targets;
  for (const std::string& pattern : patterns) {
    const std::vector<std::string> names = match_modules(root, pattern);
    QUILT_CHECK(!names.empty(), "[apply_ep] pattern '", pattern, "' matches no module of this ", root.type_name());
    for (const std::string& n : names) targets.emplace_back(n, &root.submodule(n));
  }
  for (auto& [name, m] : targets) {
    const auto params = m->named_parameters("", /*recurse=*/false);
    QUILT_CHECK(!params.empty(), "[apply_ep] '", name, "' (", m->type_name(), ") holds no grouped expert weights");
    const int64_t experts = params.front().second.size(0);
    for (const auto& [pn, p] : params)
      QUILT_CHECK(p.dim() >= 2 && p.size(0) == experts, "[apply_ep] '", name, ".", pn, "' ", p.shape(),
                  " is not one matrix per expert (", experts, " experts)");
    QUILT_CHECK(experts % ep.size() == 0, "[apply_ep] '", name, "' has num_experts ", experts,
                ", not divisible by ep_size ", ep.size());
    for (const auto& [pn, p] : params) {
      if (!p.is_distributed()) {
        distribute_parameter(*m, name, pn, ep, Shard(0), "apply_ep");
        continue;
      }
      // Already cut by the plan over a mesh whose first axis is ep (experts over ep and tp).
      const DeviceMesh& pm = mesh_of(p);
      QUILT_CHECK(pm.size(0) == ep.size() && placements_of(p)[0].is_shard() && placements_of(p)[0].dim() == 0,
                  "[apply_ep] '", name, ".", pn, "' is distributed as ", str(placements_of(p)), " on ", pm.str(),
                  ", not Shard(0) over an ep axis of ", ep.size());
    }
    if (ep.size() == 1) continue;
    auto d = std::make_shared<Dispatcher>();
    d->comm = ep.comm_ptr(0);
    d->name = name;
    d->experts = experts;
    m->register_forward_pre_hook([d](Module&, std::vector<Tensor>& in) { d->dispatch(in); });
    m->register_forward_hook([d](Module&, const std::vector<Tensor>&, std::vector<Tensor>& out) { d->combine(out); });
  }
}

EPStats ep_stats() { return {g_dispatches.load(), g_sent.load(), g_received.load()}; }

}  // namespace quilt
