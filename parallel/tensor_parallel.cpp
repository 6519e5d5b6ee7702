// Tensor parallelism by plan: see tensor_parallel.h.
#include "parallel/tensor_parallel.h"

#include "dtensor/dist_spec.h"

#include "dtensor/dtensor.h"
#include "engine/autograd.h"
#include "engine/nn/layers.h"
#include "parallel/module_names.h"

namespace quilt {
namespace {

std::string shown(const std::string& name) { return name.empty() ? "<root>" : name; }

// Every rank of the tp mesh, one placement each.
Placements on_tp(const Placement& p) { return {p}; }

// `x` as a distributed tensor on `mesh`: a plain x is this rank's piece of a tensor laid out as
// `layout` (an even split along a Shard dim unless `known` gives that dim's global size).
Tensor as_dtensor(const Tensor& x, const DeviceMesh& mesh, const Placement& layout, const std::string& who,
                  std::optional<int64_t> known = std::nullopt) {
  if (x.is_distributed()) {
    QUILT_CHECK(mesh_of(x) == mesh, "[apply_tp] ", who, ": input is distributed over ", mesh_of(x).str(),
                ", not over the tp mesh ", mesh.str());
    return x;
  }
  const Placement pl = normalize_placements(on_tp(layout), x.dim(), "apply_tp")[0];
  Shape global = x.shape();
  if (pl.is_shard()) {
    int64_t& d = global[size_t(pl.dim())];
    d = known ? *known : d * mesh.size();
  }
  return from_local(x, mesh, {pl}, global);
}

// `x` (distributed on the tp mesh) laid out as `desired`, then as a plain shard if asked.
Tensor lay_out(const Tensor& x, const Placement& desired, bool local) {
  const Placements want = normalize_placements(on_tp(desired), x.dim(), "apply_tp");
  Tensor y = has_placements(x, want) ? x : redistribute(x, want);
  return local ? to_local(y) : y;
}

void distribute_param(Module& m, const std::string& module_name, const std::string& local_name,
                      const DeviceMesh& mesh, const Placement& placement, const char* op = "apply_tp") {
  if (!m.has_parameter(local_name)) return;
  const Tensor p = m.parameter(local_name);
  if (!p.defined()) return;  // an optional parameter left out (no bias)
  QUILT_CHECK(!p.is_distributed(), "[", op, "] ", shown(module_name), ".", local_name, " is already distributed (",
              mesh_of(p).str(), "); apply tensor and expert parallelism once each, before data parallelism");
  Tensor d;
  if (is_deferred(p)) {
    // Built under DeferredInitGuard: the shard stays without storage until FSDP allocates it.
    auto spec = std::make_shared<const DistSpec>(mesh, Placements{on_tp(placement)}, p.shape());
    const Shape local = spec->local_shape();
    d = Tensor::make_distributed(Tensor::from_storage(Storage(), local, contiguous_strides(local), 0, p.dtype()), spec,
                                 p.shape());
  } else {
    NoGradGuard ng;
    d = distribute_tensor(p.detach(), mesh, on_tp(placement)).detach();
  }
  d.set_requires_grad(p.requires_grad());
  d.set_name(p.name());
  m.replace_parameter(local_name, d);
}

// Module kinds the linear styles understand.
enum class Kind { linear, embedding, other };
Kind kind_of(Module& m) {
  if (dynamic_cast<Linear*>(&m)) return Kind::linear;
  if (dynamic_cast<Embedding*>(&m)) return Kind::embedding;
  return Kind::other;
}

// Throws when `style` does not fit the module (before apply_tp changes anything).
void check_fits(Module& m, const std::string& name, const ParallelStyle& style) {
  const bool linear_style =
      std::holds_alternative<ColwiseParallel>(style) || std::holds_alternative<RowwiseParallel>(style);
  QUILT_CHECK(!linear_style || kind_of(m) != Kind::other, "[apply_tp] ", style_name(style), " on '", shown(name),
              "', a ", m.type_name(), " (it applies to Linear and Embedding)");
}

void apply_style(Module& m, const std::string& name, const DeviceMesh& mesh, const ColwiseParallel& s) {
  const Kind k = kind_of(m);
  distribute_param(m, name, "weight", mesh, k == Kind::linear ? Shard(0) : Shard(1));
  distribute_param(m, name, "bias", mesh, Shard(0));
  const Placement in = s.input_layouts.value_or(Replicate());
  m.register_forward_pre_hook([mesh, in, name](Module&, std::vector<Tensor>& inputs) {
    inputs[0] = lay_out(as_dtensor(inputs[0], mesh, in, name), Replicate(), false);
  });
  m.register_forward_hook([s](Module&, const std::vector<Tensor>&, std::vector<Tensor>& outputs) {
    outputs[0] = lay_out(outputs[0], s.output_layouts, s.use_local_output);
  });
}

void apply_style(Module& m, const std::string& name, const DeviceMesh& mesh, const RowwiseParallel& s) {
  const Kind k = kind_of(m);
  if (k == Kind::linear) {
    distribute_param(m, name, "weight", mesh, Shard(1));
    distribute_param(m, name, "bias", mesh, Replicate());
    const Placement in = s.input_layouts.value_or(Shard(-1));
    const int64_t in_features = static_cast<Linear&>(m).in_features;
    m.register_forward_pre_hook([mesh, in, name, in_features](Module&, std::vector<Tensor>& inputs) {
      const Placement pl = normalize_placements(on_tp(in), inputs[0].dim(), "apply_tp")[0];
      const bool last = pl.is_shard(inputs[0].dim() - 1);
      inputs[0] = lay_out(as_dtensor(inputs[0], mesh, pl, name, last ? std::optional<int64_t>(in_features) : std::nullopt),
                          Shard(-1), false);
    });
  } else {
    distribute_param(m, name, "weight", mesh, Shard(0));  // vocab-parallel: each rank looks up its rows
    const Placement in = s.input_layouts.value_or(Replicate());
    m.register_forward_pre_hook([mesh, in, name](Module&, std::vector<Tensor>& inputs) {
      inputs[0] = lay_out(as_dtensor(inputs[0], mesh, in, name), Replicate(), false);
    });
  }
  m.register_forward_hook([s](Module&, const std::vector<Tensor>&, std::vector<Tensor>& outputs) {
    outputs[0] = lay_out(outputs[0], s.output_layouts, s.use_local_output);
  });
}

void apply_style(Module& m, const std::string& name, const DeviceMesh& mesh, const SequenceParallel& s) {
  for (auto& [pname, p] : m.named_parameters()) {
    const size_t dot = pname.rfind('.');
    Module& owner = dot == std::string::npos ? m : m.submodule(pname.substr(0, dot));
    distribute_param(owner, name, dot == std::string::npos ? pname : pname.substr(dot + 1), mesh, Replicate());
  }
  const Placement seq = Shard(s.sequence_dim);
  m.register_forward_pre_hook([mesh, seq, name](Module&, std::vector<Tensor>& inputs) {
    inputs[0] = lay_out(as_dtensor(inputs[0], mesh, seq, name), seq, false);
  });
  m.register_forward_hook([s](Module&, const std::vector<Tensor>&, std::vector<Tensor>& outputs) {
    if (s.use_local_output) outputs[0] = to_local(outputs[0]);
  });
}

// Lays out tensors[i] for every i with a desired layout (PrepareModuleInput / -Output).
void prepare(std::vector<Tensor>& tensors, const std::vector<std::optional<Placement>>& given,
             const std::vector<std::optional<Placement>>& desired, bool local, const DeviceMesh& mesh,
             const std::string& who) {
  for (size_t i = 0; i < tensors.size() && i < desired.size(); ++i) {
    if (!desired[i] || !tensors[i].defined()) continue;
    QUILT_CHECK(tensors[i].is_distributed() || (i < given.size() && given[i]), "[apply_tp] ", who, ": tensor ", i,
                " is plain and the style gives no layout for it");
    const Placement from = i < given.size() && given[i] ? *given[i] : Placement(Replicate());
    tensors[i] = lay_out(as_dtensor(tensors[i], mesh, from, who), *desired[i], local);
  }
}

void apply_style(Module& m, const std::string& name, const DeviceMesh& mesh, const PrepareModuleInput& s) {
  m.register_forward_pre_hook([mesh, s, name](Module&, std::vector<Tensor>& inputs) {
    prepare(inputs, s.input_layouts, s.desired_input_layouts, s.use_local_output, mesh, shown(name) + " input");
  });
}

void apply_style(Module& m, const std::string& name, const DeviceMesh& mesh, const PrepareModuleOutput& s) {
  m.register_forward_hook([mesh, s, name](Module&, const std::vector<Tensor>&, std::vector<Tensor>& outputs) {
    prepare(outputs, s.output_layouts, s.desired_output_layouts, s.use_local_output, mesh, shown(name) + " output");
  });
}

}  // namespace

bool TensorParallelPlan::erase(const std::string& pattern) {
  const size_t before = entries.size();
  std::erase_if(entries, [&](const auto& e) { return e.first == pattern; });
  return entries.size() != before;
}

bool TensorParallelPlan::contains(const std::string& pattern) const {
  for (const auto& e : entries)
    if (e.first == pattern) return true;
  return false;
}

const char* style_name(const ParallelStyle& style) {
  static const char* const names[] = {"ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
                                      "PrepareModuleOutput"};
  return names[style.index()];
}

void apply_tp(Module& root, const DeviceMesh& tp_mesh, const TensorParallelPlan& plan) {
  QUILT_CHECK(tp_mesh.defined() && tp_mesh.ndim() == 1, "[apply_tp] needs the 1-D tp mesh, got ", tp_mesh.str());
  // Check every pattern before changing anything, so a bad plan leaves the model as it was.
  std::vector<std::vector<std::string>> matched;
  for (const auto& [pattern, style] : plan.entries) {
    matched.push_back(match_modules(root, pattern));
    QUILT_CHECK(!matched.back().empty(), "[apply_tp] plan entry '", pattern, "' (", style_name(style),
                ") matches no module of this ", root.type_name());
    for (const std::string& name : matched.back()) check_fits(root.submodule(name), name, style);
  }
  for (size_t i = 0; i < plan.entries.size(); ++i)
    for (const std::string& name : matched[i]) {
      Module& m = root.submodule(name);
      std::visit([&](const auto& s) { apply_style(m, name, tp_mesh, s); }, plan.entries[i].second);
    }
}

void distribute_parameter(Module& m, const std::string& module_name, const std::string& local_name,
                          const DeviceMesh& mesh, const Placement& placement, const char* op) {
  distribute_param(m, module_name, local_name, mesh, placement, op);
}

}  // namespace quilt
