// The distributed dispatcher: rule lookup by op name, n-D expansion of single-axis rows, the
// cheapest choice (cached per call signature), input redistribution, local compute, output
// wrapping, the replicated fallback with its one-time warning, and the registry of distributed
// handlers that come before the rule table.
#include "dtensor/dispatch.h"

#include "engine/nn/module.h"

#include <algorithm>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "dtensor/dtensor.h"
#include "dtensor/loss_parallel.h"
#include "dtensor/redistribute.h"
#include "dtensor/rules/rules.h"
#include "dtensor/sharding.h"
#include "engine/autograd.h"
#include "engine/ops/creation.h"

namespace quilt {

namespace rules {

Shape LocalContext::local_out_shape(size_t i) const {
  return local_block(out_shapes.at(i), mesh.shape(), out_placements.at(i), mesh.coordinate()).shape;
}

const Registry& registry() {
  static const Registry r = [] {
    Registry reg;
    register_pointwise_rules(reg);
    register_matrix_rules(reg);
    register_reduction_rules(reg);
    register_view_rules(reg);
    register_nn_rules(reg);
    register_index_rules(reg);
    register_moe_rules(reg);
    register_attention_rules(reg);
    return reg;
  }();
  return r;
}

}  // namespace rules

namespace {

using rules::ArgInfo;
using rules::OpInfo;
using rules::Row;
using rules::Strategy;

// ---- fallback warnings ----

struct Warnings {
  std::mutex mu;
  std::set<std::string> seen;
  bool print = true;
};
Warnings& warnings() {
  static Warnings w;
  return w;
}

void warn_fallback(const std::string& op, const std::vector<Placements>& cur, const std::vector<bool>& dist) {
  std::string key = op + " ";
  for (size_t i = 0; i < cur.size(); ++i) key += (i ? ", " : "") + (dist[i] ? str(cur[i]) : std::string("plain"));
  Warnings& w = warnings();
  std::lock_guard<std::mutex> lock(w.mu);
  if (!w.seen.insert(key).second) return;
  if (w.print)
    std::cerr << "[dtensor] warning: no sharding rule for '" << op << "' with inputs " << key.substr(op.size() + 1)
              << "; it runs on replicated inputs (gathered to Replicate first)\n";
}

// ---- choosing placements ----

struct Choice {
  std::vector<Placements> in, out;
};

struct Decision {
  bool fallback = false;
  Strategy strategy;
  Choice choice;
};

Row replicate_row(size_t n_out, size_t n_in) {
  return Row{std::vector<Placement>(n_out, Replicate()), std::vector<Placement>(n_in, Replicate())};
}

Choice build(const std::vector<const Row*>& per_axis, size_t n_out, size_t n_in) {
  Choice c;
  c.in.assign(n_in, Placements(per_axis.size()));
  c.out.assign(n_out, Placements(per_axis.size()));
  for (size_t a = 0; a < per_axis.size(); ++a) {
    for (size_t i = 0; i < n_in; ++i) c.in[i][a] = per_axis[a]->in[i];
    for (size_t o = 0; o < n_out; ++o) c.out[o][a] = per_axis[a]->out[o];
  }
  return c;
}

Choice choose(const Strategy& st, const std::vector<Placements>& cur, const std::vector<ArgInfo>& args,
              const Shape& mesh_shape, const std::string& op) {
  const size_t n_in = args.size(), n_out = st.out_shapes.size(), n_axes = mesh_shape.size();
  std::vector<Row> rows = st.rows;
  for (const Row& r : rows)
    QUILT_CHECK(r.in.size() == n_in && r.out.size() == n_out, "[dtensor] sharding rule of '", op, "' has a row of ",
                r.out.size(), " outputs and ", r.in.size(), " inputs; the call has ", n_out, " and ", n_in);
  const Row rep = replicate_row(n_out, n_in);
  if (std::none_of(rows.begin(), rows.end(), [&](const Row& r) { return r.in == rep.in && r.out == rep.out; }))
    rows.push_back(rep);
  std::vector<double> bytes(n_in, 0);
  for (size_t i = 0; i < n_in; ++i)
    if (args[i].defined) bytes[i] = double(numel_of(args[i].shape)) * double(dtype_size(args[i].dtype));

  auto valid = [&](const Choice& c) {
    for (const auto& p : c.in)
      if (!partials_compatible(p)) return false;
    for (const auto& p : c.out)
      if (!partials_compatible(p)) return false;
    return !st.check || st.check(mesh_shape, c.in, c.out);
  };
  auto cost_of = [&](const Choice& c, double& cost, int& changes) {
    cost = 0;
    changes = 0;
    for (size_t i = 0; i < n_in; ++i) {
      if (!args[i].defined || c.in[i] == cur[i]) continue;
      ++changes;
      cost += plan_redistribute(mesh_shape, cur[i], c.in[i]).cost * bytes[i];
    }
  };

  // The last tie-break: fewer sharded outputs. A tie between a sharded and a replicated output
  // arises where a row shards the output of unchanged (replicated) inputs for free, as expand of
  // a broadcast dim does; a later consumer can slice a Replicate output locally, but gathering a
  // Shard one costs a collective (the gradient of a loss summed over replicated rows, which loss
  // parallel needs whole on every rank of the class axis, is such an expand).
  auto shards_of = [](const Choice& c) {
    int n = 0;
    for (const auto& p : c.out)
      for (const Placement& a : p) n += a.is_shard();
    return n;
  };

  double combos = 1;
  for (size_t a = 0; a < n_axes; ++a) combos *= double(rows.size());
  std::optional<Choice> best;
  double best_cost = 0;
  int best_changes = 0, best_shards = 0;
  if (combos <= 20000) {
    std::vector<size_t> idx(n_axes, 0);
    while (true) {
      std::vector<const Row*> pick(n_axes);
      for (size_t a = 0; a < n_axes; ++a) pick[a] = &rows[idx[a]];
      Choice c = build(pick, n_out, n_in);
      if (valid(c)) {
        double cost;
        int changes;
        cost_of(c, cost, changes);
        const int shards = shards_of(c);
        const bool tie = cost <= best_cost + 1e-9;
        if (!best || cost < best_cost - 1e-9 || (tie && changes < best_changes) ||
            (tie && changes == best_changes && shards < best_shards)) {
          best = std::move(c);
          best_cost = cost;
          best_changes = changes;
          best_shards = shards;
        }
      }
      size_t a = n_axes;
      while (a > 0 && ++idx[a - 1] == rows.size()) idx[--a] = 0;
      if (a == 0) break;
    }
  } else {
    // Too many combinations: pick each axis's row on its own (others as they are now).
    std::vector<const Row*> pick(n_axes, &rows.back());
    for (size_t a = 0; a < n_axes; ++a) {
      double axis_best = 0;
      bool have = false;
      for (const Row& r : rows) {
        double cost = 0;
        for (size_t i = 0; i < n_in; ++i) {
          if (!args[i].defined) continue;
          Placements t = cur[i];
          t[a] = r.in[i];
          if (!partials_compatible(t)) { cost = 1e300; break; }
          cost += plan_redistribute(mesh_shape, cur[i], t).cost * bytes[i];
        }
        if (!have || cost < axis_best) { axis_best = cost; pick[a] = &r; have = true; }
      }
    }
    Choice c = build(pick, n_out, n_in);
    if (valid(c)) best = std::move(c);
  }
  if (!best) {
    std::vector<const Row*> pick(n_axes, &rep);
    best = build(pick, n_out, n_in);
  }
  return *best;
}

// ---- the decision cache ----

void append_attr(std::ostringstream& os, const AttrValue& v) {
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Shape>) {
          os << '[';
          for (int64_t e : x) os << e << ',';
          os << ']';
        } else {
          os << x;
        }
      },
      v);
}

std::string decision_key(const OpInfo& info, const std::vector<Placements>& cur, const Shape& mesh_shape) {
  std::ostringstream os;
  os << info.name << '|';
  for (const auto& [k, v] : info.attrs) {
    os << k << '=';
    append_attr(os, v);
    os << ';';
  }
  os << '|';
  for (size_t i = 0; i < info.args.size(); ++i) {
    const ArgInfo& a = info.args[i];
    if (!a.defined) { os << "u;"; continue; }
    os << int(a.dtype) << ':';
    for (int64_t e : a.shape) os << e << ',';
    os << str(cur[i]) << ';';
  }
  os << '|';
  for (int64_t e : mesh_shape) os << e << ',';
  return os.str();
}

struct DecisionCache {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<const Decision>> map;
};
DecisionCache& decision_cache() {
  static DecisionCache c;
  return c;
}

std::shared_ptr<const Decision> decide(const OpInfo& info, const std::vector<Placements>& cur, const Shape& mesh_shape) {
  const std::string key = decision_key(info, cur, mesh_shape);
  DecisionCache& cache = decision_cache();
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.map.find(key);
    if (it != cache.map.end()) return it->second;
  }
  auto d = std::make_shared<Decision>();
  const rules::Rule* rule = rules::registry().find(info.name);
  std::optional<Strategy> st = rule ? (*rule)(info) : std::nullopt;
  if (!st) {
    d->fallback = true;
  } else {
    d->strategy = std::move(*st);
    d->choice = choose(d->strategy, cur, info.args, mesh_shape, info.name);
  }
  std::lock_guard<std::mutex> lock(cache.mu);
  if (cache.map.size() > 200000) cache.map.clear();  // a run with ever-changing shapes
  return cache.map.emplace(key, d).first->second;
}

// ---- distributed handlers ----

struct Handlers {
  std::mutex mu;
  std::map<std::string, detail::DistHandler> map = {
      {"cross_entropy", detail::loss_parallel_cross_entropy},
      {"cross_entropy_backward", detail::loss_parallel_cross_entropy_backward},
  };
};
Handlers& handlers() {
  static Handlers h;
  return h;
}

std::optional<detail::DistHandler> handler_for(const std::string& op) {
  Handlers& h = handlers();
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.map.find(op);
  if (it == h.map.end()) return std::nullopt;
  return it->second;
}

// ---- running an op ----

Tensor local_for(const Tensor& t, const Placements& cur, const Placements& target, const DeviceMesh& mesh) {
  return detail::local_shard_for(t, cur, target, mesh);
}

std::vector<Tensor> wrap_outputs(const std::string& op, const std::vector<Tensor>& locals, const DeviceMesh& mesh,
                                 const std::vector<Placements>& placements, const std::vector<Shape>& shapes) {
  // A rule may describe outputs the op leaves out (optional gradients of backward ops).
  QUILT_CHECK(locals.size() <= shapes.size(), "[dtensor] op '", op, "' returned ", locals.size(),
              " outputs; its sharding rule describes ", shapes.size());
  std::vector<Tensor> outs(locals.size());
  for (size_t o = 0; o < locals.size(); ++o) {
    if (!locals[o].defined()) continue;
    auto spec = std::make_shared<const DistSpec>(mesh, placements[o], shapes[o]);
    QUILT_CHECK(locals[o].shape() == spec->local_shape(), "[dtensor] op '", op, "' output ", o, " on rank ",
                mesh.rank(), ": local shape ", locals[o].shape(), " but ", str(placements[o]), " of global shape ",
                shapes[o], " gives ", spec->local_shape());
    outs[o] = Tensor::make_distributed(locals[o], std::move(spec), shapes[o]);
  }
  return outs;
}

std::vector<Tensor> run_fallback(Primitive& p, const std::vector<Tensor>& inputs, const DeviceMesh& mesh,
                                 const std::vector<Placements>& cur) {
  const Placements rep = replicated(size_t(mesh.ndim()));
  std::vector<Tensor> locals(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) locals[i] = local_for(inputs[i], cur[i], rep, mesh);
  std::vector<Tensor> outs;
  {
    NoGradGuard ng;
    outs = p.forward(locals);
  }
  std::vector<Placements> pl(outs.size(), rep);
  std::vector<Shape> shapes(outs.size());
  for (size_t o = 0; o < outs.size(); ++o)
    if (outs[o].defined()) shapes[o] = outs[o].shape();
  return wrap_outputs(p.name(), outs, mesh, pl, shapes);
}

std::vector<Tensor> dispatch(Primitive& p, const std::vector<Tensor>& inputs) {
  for (const Tensor& t : inputs) detail::keep_grad_layout(t);
  if (auto* dp = dynamic_cast<detail::DistPrimitive*>(&p)) return dp->dist_forward(inputs);

  const DeviceMesh* mesh = nullptr;
  for (const Tensor& t : inputs) {
    if (!t.defined() || !t.is_distributed()) continue;
    const DeviceMesh& m = t.dist_spec()->mesh;
    if (!mesh) mesh = &m;
    else
      QUILT_CHECK(*mesh == m, "[", p.name(), "] inputs live on different meshes: ", mesh->str(), " and ", m.str(),
                  " (redistribute them onto one mesh first)");
  }
  QUILT_CHECK(mesh != nullptr, "[", p.name(), "] the distributed dispatcher got no distributed input");
  const size_t n_axes = size_t(mesh->ndim());
  if (std::optional<detail::DistHandler> h = handler_for(p.name()))
    if (std::optional<std::vector<Tensor>> outs = (*h)(p, inputs)) return std::move(*outs);

  OpInfo info;
  info.name = p.name();
  info.attrs = p.attrs();
  std::vector<Placements> cur(inputs.size(), replicated(n_axes));
  std::vector<bool> dist(inputs.size(), false);
  for (size_t i = 0; i < inputs.size(); ++i) {
    ArgInfo a;
    a.defined = inputs[i].defined();
    if (a.defined) {
      a.shape = inputs[i].shape();
      a.dtype = inputs[i].dtype();
      if (inputs[i].is_distributed()) {
        cur[i] = inputs[i].dist_spec()->placements;
        dist[i] = true;
      }
    }
    info.args.push_back(std::move(a));
  }

  std::shared_ptr<const Decision> d = decide(info, cur, mesh->shape());
  if (d->fallback) {
    warn_fallback(info.name, cur, dist);
    return run_fallback(p, inputs, *mesh, cur);
  }
  const Choice& c = d->choice;
  std::vector<Tensor> locals(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) locals[i] = local_for(inputs[i], cur[i], c.in[i], *mesh);
  std::vector<Tensor> outs;
  {
    NoGradGuard ng;
    if (d->strategy.local) {
      const rules::LocalContext ctx{*mesh, d->strategy.out_shapes, c.out, c.in};
      outs = d->strategy.local(p, locals, ctx);
    } else {
      outs = p.forward(locals);
    }
  }
  return wrap_outputs(info.name, outs, *mesh, c.out, d->strategy.out_shapes);
}

Tensor dist_zeros(const TensorMeta& m) {
  const DistSpec& s = *m.dist;
  Tensor local = zeros(s.local_shape(), {.dtype = m.dtype, .device = m.device});
  return Tensor::make_distributed(local, m.dist, m.shape);
}

// Redistributes a leaf's incoming gradient to the leaf's layout.
struct GradLayoutHook {
  std::shared_ptr<const DistSpec> spec;
  Tensor operator()(const Tensor& g) const {
    if (!g.defined()) return {};
    Tensor d = g;
    if (!d.is_distributed())
      d = Tensor::make_distributed(
          g, std::make_shared<const DistSpec>(spec->mesh, replicated(spec->placements.size()), g.shape()), g.shape());
    const DistSpec& gs = *d.dist_spec();
    if (gs == *spec) return d;
    QUILT_CHECK(gs.mesh == spec->mesh, "[backward] gradient on mesh ", gs.mesh.str(), " for a parameter on mesh ",
                spec->mesh.str());
    return redistribute(d, spec->placements);
  }
};

// A plain leaf used beside distributed tensors is a replicated value: its gradient is the full
// gradient, the same on every rank.
struct PlainGradHook {
  Tensor operator()(const Tensor& g) const {
    if (!g.defined() || !g.is_distributed()) return {};
    return full_tensor(g);
  }
};

}  // namespace

std::vector<std::string> dtensor_fallback_warnings() {
  Warnings& w = warnings();
  std::lock_guard<std::mutex> lock(w.mu);
  return {w.seen.begin(), w.seen.end()};
}

void set_dtensor_fallback_warnings_printed(bool on) {
  Warnings& w = warnings();
  std::lock_guard<std::mutex> lock(w.mu);
  w.print = on;
}

namespace detail {

void register_dist_handler(const std::string& name, DistHandler handler) {
  Handlers& h = handlers();
  std::lock_guard<std::mutex> lock(h.mu);
  h.map[name] = std::move(handler);
}

Tensor local_shard_for(const Tensor& t, const Placements& cur, const Placements& target, const DeviceMesh& mesh) {
  if (!t.defined()) return t;
  if (t.is_distributed()) {
    if (cur == target) return t.local();
    return redistribute_local(t.local(), *t.dist_spec(), target);
  }
  if (std::all_of(target.begin(), target.end(), [](const Placement& p) { return p.is_replicate(); })) return t;
  return redistribute_local(t, DistSpec(mesh, cur, t.shape()), target);
}

void ensure_dtensor_dispatch() {
  static std::once_flag once;
  std::call_once(once, [] {
    set_distributed_dispatch(dispatch);
    set_distributed_zeros(dist_zeros);
    set_dist_spec_equal([](const DistSpec& a, const DistSpec& b) { return a == b; });
    // Random initialisers fill a shard with the values its full tensor has there.
    init::set_global_view_resolver([](const Tensor& t) {
      const DistSpec& s = *t.dist_spec();
      return GlobalView{s.shape, s.local_offset()};
    });
  });
}

void keep_grad_layout(const Tensor& leaf) {
  if (!leaf.defined() || !leaf.requires_grad() || !leaf.is_leaf()) return;
  auto& hooks = leaf.unsafe_impl()->meta().hooks;
  for (const GradHook& h : hooks)
    if (h.target<GradLayoutHook>() || h.target<PlainGradHook>()) return;
  if (leaf.is_distributed()) hooks.push_back(GradLayoutHook{leaf.dist_spec()});
  else hooks.push_back(PlainGradHook{});
}

}  // namespace detail
}  // namespace quilt
