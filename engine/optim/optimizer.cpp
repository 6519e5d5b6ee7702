// Optimizer base: groups, keys, the step loop (checks, contiguity, lazy state), state dicts.
#include "engine/optim/optimizer.h"

#include <map>
#include <unordered_map>
#include <unordered_set>

#include "engine/autograd.h"
#include "engine/device.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"

namespace quilt {
namespace {

std::string join_list(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

}  // namespace

Optimizer::Optimizer(const char* name, std::vector<ParamGroup> groups, double default_lr, double default_wd,
                     std::vector<std::string> buffer_names)
    : name_(name), buffer_names_(std::move(buffer_names)) {
  QUILT_CHECK(!groups.empty(), "[", name_, "] needs at least one parameter group");
  std::unordered_set<const TensorImpl*> seen;
  std::unordered_set<std::string> names;
  bool names_usable = true;
  size_t index = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    Group gr;
    gr.lr = groups[g].lr.value_or(default_lr);
    gr.weight_decay = groups[g].weight_decay.value_or(default_wd);
    QUILT_CHECK(gr.lr >= 0, "[", name_, "] group ", g, ": lr must be >= 0, got ", gr.lr);
    QUILT_CHECK(gr.weight_decay >= 0, "[", name_, "] group ", g, ": weight_decay must be >= 0, got ", gr.weight_decay);
    for (const Tensor& p : groups[g].params) {
      QUILT_CHECK(p.defined(), "[", name_, "] group ", g, " holds an undefined tensor at position ", gr.params.size());
      QUILT_CHECK(p.is_leaf(), "[", name_, "] parameter '", p.name(), "' is not a leaf tensor");
      QUILT_CHECK(is_floating(p.dtype()), "[", name_, "] parameter '", p.name(), "' is ",
                  dtype_name(p.dtype()), ", not floating");
      QUILT_CHECK(seen.insert(p.unsafe_impl()).second, "[", name_, "] parameter '", p.name(), "' (index ", index,
                  ") appears more than once");
      names_usable = names_usable && !p.name().empty() && names.insert(p.name()).second;
      gr.params.push_back(p);
      ++index;
    }
    gr.state.resize(gr.params.size());
    groups_.push_back(std::move(gr));
  }
  index = 0;
  for (Group& gr : groups_)
    for (const Tensor& p : gr.params) gr.keys.push_back(names_usable ? p.name() : std::to_string(index++));
}

const Optimizer::Group& Optimizer::group(size_t g) const {
  QUILT_CHECK(g < groups_.size(), "[", name_, "] group ", g, " out of range (", groups_.size(), " groups)");
  return groups_[g];
}

const std::vector<Tensor>& Optimizer::group_params(size_t g) const { return group(g).params; }
double Optimizer::group_lr(size_t g) const { return group(g).lr; }
double Optimizer::group_weight_decay(size_t g) const { return group(g).weight_decay; }
void Optimizer::set_group_lr(size_t g, double lr) {
  QUILT_CHECK(lr >= 0, "[", name_, "] lr must be >= 0, got ", lr);
  const_cast<Group&>(group(g)).lr = lr;
}
void Optimizer::set_group_weight_decay(size_t g, double wd) {
  QUILT_CHECK(wd >= 0, "[", name_, "] weight_decay must be >= 0, got ", wd);
  const_cast<Group&>(group(g)).weight_decay = wd;
}
void Optimizer::set_lr(double lr) {
  for (size_t g = 0; g < groups_.size(); ++g) set_group_lr(g, lr);
}
const std::string& Optimizer::param_key(size_t g, size_t i) const {
  const Group& gr = group(g);
  QUILT_CHECK(i < gr.keys.size(), "[", name_, "] group ", g, " has no parameter ", i);
  return gr.keys[i];
}

Tensor Optimizer::new_buffer(const Tensor& param) const {
  // State of a shard is a shard of the same layout, so a distributed checkpoint can place it.
  const Tensor local = param.local();
  Tensor b = zeros(local.shape(), {.dtype = state_dtype(param), .device = local.device()});
  return param.is_distributed() ? Tensor::make_distributed(b, param.dist_spec(), param.shape()) : b;
}

void Optimizer::update_all(std::vector<Update>& updates) {
  for (Update& u : updates) update(u.param, u.grad, u.buffers, u.step, u.lr, u.weight_decay);
}

void Optimizer::update_all_cuda(std::vector<Update>&, const kernels::cuda::OptimLaunch&) {
  fail("[", name_, "] has no CUDA implementation");
}
size_t Optimizer::cuda_table_bytes(std::vector<Update>&) { fail("[", name_, "] has no CUDA implementation"); }
void Optimizer::stage_cuda(std::vector<Update>&, const kernels::cuda::StagedTable&) {
  fail("[", name_, "] has no CUDA implementation");
}

void Optimizer::prepare_graph_steps(Tensor skip) {
  QUILT_CHECK(!skip.defined() || (skip.dtype() == DType::b8 && skip.numel() == 1 && skip.device().is_cuda()),
              "[", name_, "] prepare_graph_steps: skip must be a one-element bool tensor on a GPU, got ",
              dtype_name(skip.dtype()), " ", skip.shape(), " on ", skip.device().str());
  graph_steps_ = true;
  skip_ = skip;
}

kernels::cuda::OptimLaunch Optimizer::graph_launch(int device, std::vector<Update>& updates) {
  GraphDevice& gd = graph_[device];
  const size_t bytes = cuda_table_bytes(updates);
  if (cuda::capture_underway()) {
    // The capture must update what the eager step that sized the tables did: the same
    // parameters in the same order (their tables are staged in that layout at every replay).
    bool same = gd.table.bytes >= bytes && gd.updates.size() == updates.size();
    for (size_t k = 0; same && k < updates.size(); ++k)
      same = gd.updates[k].param.data_ptr() == updates[k].param.data_ptr();
    QUILT_CHECK(same, "[", name_, "] the captured step updates ", updates.size(), " parameters on ",
                Device::cuda(device).str(), ", the eager step before it ", gd.updates.size(),
                " (or others): run one step eagerly after prepare_graph_steps() that updates what the capture will");
  }
  if (gd.table.bytes < bytes) {
    // The old tables may still be read by the last step's copy.
    if (gd.host.defined()) synchronize(current_stream(Device::cuda(device)));
    gd.host = Tensor::empty({int64_t(bytes)}, {.dtype = DType::b8, .pinned = true});
    gd.device = Tensor::empty({int64_t(bytes)}, {.dtype = DType::b8, .device = Device::cuda(device)});
    gd.table = {.host = gd.host.data_ptr(), .device = gd.device.data_ptr(), .bytes = bytes};
  }
  QUILT_CHECK(!skip_.defined() || skip_.device() == Device::cuda(device), "[", name_, "] the skip flag is on ",
              skip_.device().str(), " but parameters on ", Device::cuda(device).str());
  return {.skip = skip_.defined() ? static_cast<const bool*>(skip_.data_ptr()) : nullptr, .table = &gd.table};
}

void Optimizer::stage_replay() {
  QUILT_CHECK(graph_steps_ && !graph_.empty(), "[", name_, "] stage_replay() without a step under prepare_graph_steps()");
  ++step_count_;
  for (auto& [dev, gd] : graph_) {
    for (size_t k = 0; k < gd.updates.size(); ++k) {
      Group& gr = *gd.refs[k].group;
      Update& u = gd.updates[k];
      u.step = ++gr.state[gd.refs[k].index].step;
      u.lr = gr.lr;
      u.weight_decay = gr.weight_decay;
    }
    stage_cuda(gd.updates, gd.table);
  }
}

void Optimizer::unstep() {
  QUILT_CHECK(graph_steps_ && step_count_ > 0, "[", name_, "] unstep() without a step under prepare_graph_steps()");
  --step_count_;
  for (auto& [dev, gd] : graph_)
    for (const StateRef& r : gd.refs) --r.group->state[r.index].step;
}

void Optimizer::step() {
  NoGradGuard ng;
  // Every parameter is checked before any state changes, so a bad one leaves the whole step
  // undone; then all updates are applied at once (one parallel region for AdamW).
  struct Pending {
    Group* group;
    size_t index;
    Tensor param, grad;
  };
  std::vector<Pending> pending;
  for (Group& gr : groups_) {
    for (size_t i = 0; i < gr.params.size(); ++i) {
      const Tensor& p = gr.params[i];
      const Tensor full_grad = p.grad();
      if (!full_grad.defined()) continue;
      QUILT_CHECK(full_grad.shape() == p.shape(), "[", name_, "] gradient of shape ", full_grad.shape(),
                  " for parameter '", gr.keys[i], "' of shape ", p.shape());
      QUILT_CHECK(same_layout(p, full_grad), "[", name_, "] the gradient of parameter '", gr.keys[i],
                  "' is laid out differently from the parameter; redistribute it first");
      // Updates touch only this rank's data: the shard of a distributed parameter.
      Tensor param = p.local();
      Tensor grad = full_grad.local();
      QUILT_CHECK(param.device() == grad.device(), "[", name_, "] parameter '", gr.keys[i], "' is on ",
                  param.device().str(), " but its gradient on ", grad.device().str());
      QUILT_CHECK(param.is_contiguous(), "[", name_, "] parameter '", gr.keys[i], "' is not contiguous (shape ",
                  param.shape(), ", strides ", param.strides(), ")");
      if (!grad.is_contiguous()) grad = contiguous(grad);
      if (grad.dtype() != param.dtype() && grad.dtype() != DType::f32) grad = cast(grad, param.dtype());
      pending.push_back({&gr, i, std::move(param), std::move(grad)});
    }
  }
  ++step_count_;
  std::vector<Update> updates;
  updates.reserve(pending.size());
  for (Pending& pd : pending) {
    ParamState& st = pd.group->state[pd.index];
    QUILT_CHECK(!st.buffers.empty() || !graph_steps_ || !cuda::capture_underway(), "[", name_, "] parameter '",
                pd.group->keys[pd.index], "' gets its first gradient in a captured step, whose replays would zero its "
                "state again each time: capture after an eager step that updates every parameter the graph does");
    if (st.buffers.empty())
      for (size_t b = 0; b < buffer_names_.size(); ++b) st.buffers.push_back(new_buffer(pd.group->params[pd.index]));
    ++st.step;
    Update u{.param = std::move(pd.param), .grad = std::move(pd.grad), .buffers = {}, .step = st.step,
             .lr = pd.group->lr, .weight_decay = pd.group->weight_decay};
    for (const Tensor& b : st.buffers) u.buffers.push_back(b.local());
    updates.push_back(std::move(u));
  }
  // CPU parameters in one update_all(); CUDA ones per device, one multi-tensor call each.
  std::vector<Update> cpu_updates;
  std::map<int, std::vector<Update>> cuda_updates;  // by device index
  std::map<int, std::vector<StateRef>> cuda_refs;
  for (size_t k = 0; k < updates.size(); ++k) {
    Update& u = updates[k];
    if (u.param.device().is_cpu()) {
      cpu_updates.push_back(std::move(u));
    } else {
      cuda_refs[u.param.device().index].push_back({pending[k].group, pending[k].index});
      cuda_updates[u.param.device().index].push_back(std::move(u));
    }
  }
  if (!cpu_updates.empty() || cuda_updates.empty()) update_all(cpu_updates);
  for (auto& [dev, list] : cuda_updates) {
    if (!graph_steps_) {
      update_all_cuda(list, {});
      continue;
    }
    update_all_cuda(list, graph_launch(dev, list));
    graph_[dev].updates = list;
    graph_[dev].refs = std::move(cuda_refs[dev]);
  }
}

void Optimizer::zero_grad(bool set_to_none) {
  NoGradGuard ng;
  for (Group& gr : groups_)
    for (Tensor& p : gr.params) {
      Tensor g = p.grad();
      if (!g.defined()) continue;
      if (set_to_none) p.set_grad(Tensor());
      else g.zero_();
    }
}

OptimizerState Optimizer::state_dict() const {
  OptimizerState s;
  s.scalars.insert("step", double(step_count_));
  for (size_t g = 0; g < groups_.size(); ++g) {
    s.scalars.insert("param_groups." + std::to_string(g) + ".lr", groups_[g].lr);
    s.scalars.insert("param_groups." + std::to_string(g) + ".weight_decay", groups_[g].weight_decay);
  }
  for (const Group& gr : groups_)
    for (size_t i = 0; i < gr.params.size(); ++i) {
      const ParamState& st = gr.state[i];
      if (st.step == 0) continue;
      const std::string base = "state." + gr.keys[i] + ".";
      s.scalars.insert(base + "step", double(st.step));
      for (size_t b = 0; b < buffer_names_.size(); ++b) s.tensors.insert(base + buffer_names_[b], st.buffers[b].detach());
    }
  return s;
}

void Optimizer::load_state_dict(const OptimizerState& s) {
  std::unordered_map<std::string, std::pair<size_t, size_t>> where;
  for (size_t g = 0; g < groups_.size(); ++g)
    for (size_t i = 0; i < groups_[g].keys.size(); ++i) where[groups_[g].keys[i]] = {g, i};

  std::vector<std::string> unexpected, missing, problems;
  std::unordered_set<std::string> stepped;  // param keys with a "state.<key>.step"
  std::unordered_set<std::string> group_keys;
  for (size_t g = 0; g < groups_.size(); ++g)
    for (const char* f : {"lr", "weight_decay"}) group_keys.insert("param_groups." + std::to_string(g) + "." + f);
  for (const auto& [key, v] : s.scalars) {
    if (key == "step" || group_keys.count(key)) continue;
    if (starts_with(key, "state.") && ends_with(key, ".step")) {
      const std::string pk = key.substr(6, key.size() - 6 - 5);
      if (where.count(pk)) { stepped.insert(pk); continue; }
    }
    unexpected.push_back(key);
  }
  if (!s.scalars.contains("step")) missing.push_back("step");
  for (size_t g = 0; g < groups_.size(); ++g)
    for (const char* f : {"lr", "weight_decay"}) {
      const std::string key = "param_groups." + std::to_string(g) + "." + f;
      if (!s.scalars.contains(key)) missing.push_back(key);
    }
  for (const auto& [key, t] : s.tensors) {
    bool ok = false;
    for (size_t b = 0; b < buffer_names_.size() && !ok; ++b) {
      const std::string suffix = "." + buffer_names_[b];
      if (!starts_with(key, "state.") || !ends_with(key, suffix)) continue;
      const std::string pk = key.substr(6, key.size() - 6 - suffix.size());
      auto it = where.find(pk);
      if (it == where.end() || !stepped.count(pk)) continue;
      ok = true;
      const Tensor& p = groups_[it->second.first].params[it->second.second];
      if (!t.defined() || t.shape() != p.shape())
        problems.push_back(detail::concat("shape mismatch for ", key, ": state ", t.defined() ? t.shape() : Shape{},
                                          " vs parameter ", p.shape()));
    }
    if (!ok) unexpected.push_back(key);
  }
  for (const Group& gr : groups_)  // in parameter order, so the message is stable
    for (const std::string& pk : gr.keys)
      for (const std::string& b : buffer_names_)
        if (stepped.count(pk) && !s.tensors.contains("state." + pk + "." + b)) missing.push_back("state." + pk + "." + b);

  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back("missing keys: " + join_list(missing));
  if (!unexpected.empty()) parts.push_back("unexpected keys: " + join_list(unexpected));
  parts.insert(parts.end(), problems.begin(), problems.end());
  if (!parts.empty()) {
    std::string msg;
    for (size_t i = 0; i < parts.size(); ++i) msg += (i ? "; " : "") + parts[i];
    fail("[", name_, "] load_state_dict: ", msg);
  }

  NoGradGuard ng;
  step_count_ = int64_t(s.scalars.at("step"));
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& gr = groups_[g];
    gr.lr = s.scalars.at("param_groups." + std::to_string(g) + ".lr");
    gr.weight_decay = s.scalars.at("param_groups." + std::to_string(g) + ".weight_decay");
    for (size_t i = 0; i < gr.params.size(); ++i) {
      ParamState& st = gr.state[i];
      st = ParamState{};
      if (!stepped.count(gr.keys[i])) continue;
      st.step = int64_t(s.scalars.at("state." + gr.keys[i] + ".step"));
      for (const std::string& b : buffer_names_) {
        Tensor buf = new_buffer(gr.params[i]);
        buf.copy_(s.tensors.at("state." + gr.keys[i] + "." + b));
        st.buffers.push_back(buf);
      }
    }
  }
}

}  // namespace quilt
