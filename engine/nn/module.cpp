// Module tree: slots, traversal, dotted lookup, hooks, init, state dicts, conversion.
#include "engine/nn/module.h"

#include <atomic>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "engine/autograd.h"
#include "engine/ops/view.h"

namespace quilt {
namespace {

std::atomic<uint64_t> g_next_hook_id{1};

init::GlobalViewResolver& resolver() {
  static init::GlobalViewResolver fn;
  return fn;
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Splits "a.b.c" into ("a.b", "c"); no dot gives ("", name).
std::pair<std::string, std::string> split_last(const std::string& dotted) {
  const size_t p = dotted.rfind('.');
  if (p == std::string::npos) return {"", dotted};
  return {dotted.substr(0, p), dotted.substr(p + 1)};
}

// Values are drawn in f32 (f64 for f64 tensors) and rounded to the tensor's dtype, so a bf16
// model starts from the rounded f32 model.
DType draw_dtype(const Tensor& t) { return t.dtype() == DType::f64 ? DType::f64 : DType::f32; }

GlobalView global_view_of(const Tensor& t, const char* op) {
  if (!t.is_distributed()) return {};
  QUILT_CHECK(static_cast<bool>(resolver()), "[", op, "] tensor '", t.name(),
              "' is distributed but no global-view resolver is installed (dtensor/ installs one)");
  return resolver()(t);
}

std::string join_list(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

}  // namespace

namespace init {

// Random fills write the local block (a distributed tensor's shard) with the values the
// full tensor has at those global positions.
void normal_(Tensor& t, RngKey key, double mean, double std) {
  NoGradGuard ng;
  Tensor dst = t.local();
  dst.copy_(randn(dst.shape(), key, {.dtype = draw_dtype(t), .device = dst.device()}, mean, std,
                  global_view_of(t, "init::normal_")));
}

void uniform_(Tensor& t, RngKey key, double low, double high) {
  NoGradGuard ng;
  Tensor dst = t.local();
  dst.copy_(rand(dst.shape(), key, {.dtype = draw_dtype(t), .device = dst.device()}, low, high,
                 global_view_of(t, "init::uniform_")));
}

void constant_(Tensor& t, double value) {
  NoGradGuard ng;
  t.local().fill_(value);  // every element of a shard is an element of the full tensor
}

void set_global_view_resolver(GlobalViewResolver fn) { resolver() = std::move(fn); }

}  // namespace init

Module::Module(std::string type_name) : type_name_(std::move(type_name)) {}

Module::~Module() {
  for (auto& [n, c] : children_)
    if (c->parent_ == this) c->parent_ = nullptr;  // a child held elsewhere outlives us as a root
}

std::string Module::path() const {
  std::string p;
  for (const Module* m = this; m->parent_; m = m->parent_) p = p.empty() ? m->name_in_parent_ : m->name_in_parent_ + "." + p;
  return p;
}

Tensor Module::forward(const Tensor&) {
  fail("[", type_name_, "] has no forward(const Tensor&); call its own call operator or its children");
}

Tensor Module::operator()(const Tensor& x) {
  auto outs = call_with_hooks({x}, [this](const std::vector<Tensor>& in) { return std::vector<Tensor>{forward(in[0])}; });
  QUILT_CHECK(!outs.empty(), "[", type_name_, "] a forward hook left no outputs");
  return outs[0];
}

std::vector<Tensor> Module::call_with_hooks(
    std::vector<Tensor> inputs, const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& body) {
  if (pre_hooks_.empty() && post_hooks_.empty() && !wrapper_) return body(inputs);
  // Copies, so a hook may remove itself (or add others) while we iterate.
  auto pre = pre_hooks_;
  for (auto& [id, h] : pre) h(*this, inputs);
  std::vector<Tensor> outputs = wrapper_ ? wrapper_(inputs, body) : body(inputs);
  auto post = post_hooks_;
  for (auto& [id, h] : post) h(*this, inputs, outputs);
  return outputs;
}

// ---- registration ----

void Module::check_new_name(const std::string& name, const char* what) const {
  QUILT_CHECK(!name.empty() && name.find('.') == std::string::npos, "[", type_name_, "] ", what, " name '", name,
              "' must be non-empty and contain no '.'");
  auto taken = [&](const auto& slots) {
    for (const auto& s : slots)
      if (s->name == name) return true;
    return false;
  };
  bool dup = taken(params_) || taken(buffers_);
  for (const auto& [n, c] : children_) dup = dup || n == name;
  QUILT_CHECK(!dup, "[", type_name_, "] cannot register ", what, " '", name, "': the name is already taken");
}

namespace {
thread_local bool t_deferred_init = false;
}  // namespace

DeferredInitGuard::DeferredInitGuard() : prev_(t_deferred_init) { t_deferred_init = true; }
DeferredInitGuard::~DeferredInitGuard() { t_deferred_init = prev_; }
bool deferred_init_enabled() { return t_deferred_init; }
bool is_deferred(const Tensor& t) { return t.defined() && !t.local().storage().defined(); }

Tensor& Module::register_parameter(const std::string& name, Tensor value, bool requires_grad) {
  check_new_name(name, "parameter");
  if (value.defined() && t_deferred_init && !value.is_distributed())
    value = Tensor::from_storage(Storage(), value.shape(), contiguous_strides(value.shape()), 0, value.dtype());
  if (value.defined()) {
    if (!value.is_leaf()) value = value.detach();
    value.set_requires_grad(requires_grad);
    value.set_name(join(path(), name));
  }
  params_.push_back(std::make_unique<Slot>(Slot{name, std::move(value), true}));
  return params_.back()->value;
}

Tensor& Module::register_buffer(const std::string& name, Tensor value, bool persistent) {
  check_new_name(name, "buffer");
  if (value.defined()) value.set_name(join(path(), name));
  buffers_.push_back(std::make_unique<Slot>(Slot{name, std::move(value), persistent}));
  return buffers_.back()->value;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> child) {
  QUILT_CHECK(child != nullptr, "[", type_name_, "] cannot register a null module as '", name, "'");
  QUILT_CHECK(child.get() != this, "[", type_name_, "] cannot register a module as its own child '", name, "'");
  check_new_name(name, "module");
  for (const Module* m = this; m; m = m->parent_)
    QUILT_CHECK(m != child.get(), "[", type_name_, "] cannot register an ancestor as child '", name, "'");
  child->parent_ = this;
  child->name_in_parent_ = name;
  // Names stay relative to the topmost module: rename the subtree under its new path.
  const std::string prefix = child->path();
  auto rename = [&](Module&, const Slot&, const std::string& full, Tensor& v) {
    if (v.defined()) v.set_name(full);
  };
  child->visit_slots(false, prefix, true, rename);
  child->visit_slots(true, prefix, true, rename);
  children_.emplace_back(name, std::move(child));
}

// ---- traversal ----

void Module::visit_slots(bool buffers, const std::string& prefix, bool recurse, const SlotVisitor& fn) const {
  Module& self = const_cast<Module&>(*this);
  for (const auto& s : buffers ? buffers_ : params_) fn(self, *s, join(prefix, s->name), s->value);
  if (!recurse) return;
  for (const auto& [n, c] : children_) c->visit_slots(buffers, join(prefix, n), true, fn);
}

NamedTensors Module::named_parameters(const std::string& prefix, bool recurse) const {
  NamedTensors out;
  std::unordered_set<const TensorImpl*> seen;
  visit_slots(false, prefix, recurse, [&](Module&, const Slot&, const std::string& full, Tensor& v) {
    if (v.defined() && seen.insert(v.unsafe_impl()).second) out.emplace_back(full, v);
  });
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters("", recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(const std::string& prefix, bool recurse) const {
  NamedTensors out;
  visit_slots(true, prefix, recurse, [&](Module&, const Slot&, const std::string& full, Tensor& v) {
    if (v.defined()) out.emplace_back(full, v);
  });
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const { return children_; }

std::vector<std::pair<std::string, Module*>> Module::named_modules(const std::string& prefix) {
  std::vector<std::pair<std::string, Module*>> out;
  apply([&](const std::string& name, Module& m) { out.emplace_back(join(prefix, name), &m); });
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::apply(const std::function<void(const std::string&, Module&)>& fn) {
  std::function<void(const std::string&, Module&)> walk = [&](const std::string& name, Module& m) {
    fn(name, m);
    for (auto& [n, c] : m.children_) walk(join(name, n), *c);
  };
  walk("", *this);
}

// ---- lookup ----

Module& Module::submodule(const std::string& dotted_name) {
  Module* m = this;
  std::string path;
  size_t start = 0;
  while (start < dotted_name.size()) {
    size_t end = dotted_name.find('.', start);
    if (end == std::string::npos) end = dotted_name.size();
    const std::string part = dotted_name.substr(start, end - start);
    Module* next = nullptr;
    for (auto& [n, c] : m->children_)
      if (n == part) next = c.get();
    if (!next) {
      std::vector<std::string> names;
      for (auto& [n, c] : m->children_) names.push_back(n);
      fail("[", type_name_, "] no submodule '", dotted_name, "': '", path.empty() ? type_name_ : path,
           "' has no child '", part, "' (children: ", names.empty() ? "none" : join_list(names), ")");
    }
    path = join(path, part);
    m = next;
    start = end + 1;
  }
  return *m;
}

Module::Slot* Module::find_slot(const std::string& dotted_name, bool buffer) const {
  auto [path, leaf] = split_last(dotted_name);
  Module* owner = const_cast<Module*>(this);
  if (!path.empty()) {
    // A missing submodule means a missing tensor: answer nullptr rather than throw.
    for (size_t start = 0; owner && start <= path.size();) {
      size_t end = path.find('.', start);
      if (end == std::string::npos) end = path.size();
      const std::string part = path.substr(start, end - start);
      Module* next = nullptr;
      for (auto& [n, c] : owner->children_)
        if (n == part) next = c.get();
      owner = next;
      start = end + 1;
    }
    if (!owner) return nullptr;
  }
  for (auto& s : buffer ? owner->buffers_ : owner->params_)
    if (s->name == leaf) return s.get();
  return nullptr;
}

Tensor& Module::parameter(const std::string& dotted_name) {
  Slot* s = find_slot(dotted_name, false);
  QUILT_CHECK(s != nullptr, "[", type_name_, "] no parameter '", dotted_name, "'");
  return s->value;
}

const Tensor& Module::parameter(const std::string& dotted_name) const {
  return const_cast<Module*>(this)->parameter(dotted_name);
}

Tensor& Module::buffer(const std::string& dotted_name) {
  Slot* s = find_slot(dotted_name, true);
  QUILT_CHECK(s != nullptr, "[", type_name_, "] no buffer '", dotted_name, "'");
  return s->value;
}

bool Module::has_parameter(const std::string& dotted_name) const { return find_slot(dotted_name, false) != nullptr; }
bool Module::has_buffer(const std::string& dotted_name) const { return find_slot(dotted_name, true) != nullptr; }

void Module::replace_parameter(const std::string& dotted_name, Tensor value) {
  Tensor& slot = parameter(dotted_name);
  if (value.defined() && value.name().empty()) value.set_name(dotted_name);  // a tied tensor keeps its first name
  slot = std::move(value);
}

void Module::replace_buffer(const std::string& dotted_name, Tensor value) {
  Tensor& slot = buffer(dotted_name);
  if (value.defined() && value.name().empty()) value.set_name(dotted_name);
  slot = std::move(value);
}

// ---- mode ----

void Module::train(bool on) {
  apply([on](const std::string&, Module& m) { m.training_ = on; });
}

// ---- init ----

void Module::reset_parameter(const std::string& local_name, Tensor&, RngKey) {
  fail("[init_weights] ", type_name_, " does not say how to initialise its parameter '", local_name,
       "' (override reset_parameter)");
}

void Module::init_weights(uint64_t seed) {
  std::unordered_set<const TensorImpl*> done;  // a tied tensor is initialised once, by its first name
  visit_slots(false, "", true, [&](Module& owner, const Slot& slot, const std::string& full, Tensor& v) {
    if (!v.defined() || !done.insert(v.unsafe_impl()).second) return;
    QUILT_CHECK(!is_deferred(v), "[init_weights] parameter '", full, "' has no storage (built under DeferredInitGuard): "
                "shard the model with fully_shard first, then initialise it");
    v.set_name(full);
    NoGradGuard ng;
    owner.reset_parameter(slot.name, v, RngKey(seed, full));
  });
}

// ---- state ----

StateDict Module::state_dict() const {
  StateDict out;
  std::function<void(const Module&, const std::string&)> walk = [&](const Module& m, const std::string& prefix) {
    for (const auto& s : m.params_)
      if (s->value.defined()) out.insert(join(prefix, s->name), s->value.detach());
    for (const auto& s : m.buffers_)
      if (s->value.defined() && s->persistent) out.insert(join(prefix, s->name), s->value.detach());
    for (const auto& [n, c] : m.children_) walk(*c, join(prefix, n));
  };
  walk(*this, "");
  return out;
}

LoadResult Module::load_state_dict(const StateDict& dict, bool strict) {
  const StateDict mine = state_dict();
  LoadResult r;
  std::vector<std::string> mismatches;
  for (const auto& [key, t] : mine) {
    const Tensor* src = dict.find(key);
    if (!src || !src->defined()) {
      r.missing_keys.push_back(key);
      continue;
    }
    if (src->shape() != t.shape())
      mismatches.push_back(detail::concat("shape mismatch for ", key, ": checkpoint ", src->shape(), " vs model ",
                                          t.shape()));
    else if (src->dtype() != t.dtype())
      mismatches.push_back(detail::concat("dtype mismatch for ", key, ": checkpoint ", dtype_name(src->dtype()),
                                          " vs model ", dtype_name(t.dtype())));
  }
  for (const auto& [key, t] : dict)
    if (!mine.contains(key)) r.unexpected_keys.push_back(key);

  std::vector<std::string> parts;
  if (strict && !r.missing_keys.empty()) parts.push_back("missing keys: " + join_list(r.missing_keys));
  if (strict && !r.unexpected_keys.empty()) parts.push_back("unexpected keys: " + join_list(r.unexpected_keys));
  parts.insert(parts.end(), mismatches.begin(), mismatches.end());
  if (!parts.empty()) {
    std::string msg;
    for (size_t i = 0; i < parts.size(); ++i) msg += (i ? "; " : "") + parts[i];
    fail("[load_state_dict] ", msg);
  }

  NoGradGuard ng;
  for (const auto& [key, t] : mine) {
    const Tensor* src = dict.find(key);
    if (!src || !src->defined()) continue;
    Tensor dst = t;  // shares the module's storage
    dst.copy_(*src);
  }
  return r;
}

// ---- conversion ----

void Module::replace_everywhere(const std::function<Tensor(const Tensor&)>& convert) {
  std::unordered_map<const TensorImpl*, Tensor> done;  // keeps tied tensors tied
  NoGradGuard ng;
  auto visit = [&](Module&, const Slot&, const std::string&, Tensor& v) {
    if (!v.defined()) return;
    auto it = done.find(v.unsafe_impl());
    if (it == done.end()) {
      const Tensor d = v.detach();
      Tensor n = convert(d);
      if (n.is_same(d)) {
        n = v;  // nothing to convert: keep the tensor (and its gradient)
      } else {
        n.set_name(v.name());
        if (v.requires_grad()) n.set_requires_grad(true);
      }
      it = done.emplace(v.unsafe_impl(), n).first;
    }
    v = it->second;
  };
  visit_slots(false, "", true, visit);
  visit_slots(true, "", true, visit);
}

Module& Module::to(DType dtype) {
  replace_everywhere(
      [&](const Tensor& t) { return is_floating(t.dtype()) && t.dtype() != dtype ? quilt::to(t, dtype) : t; });
  return *this;
}

Module& Module::to(Device device) {
  replace_everywhere([&](const Tensor& t) { return t.device() == device ? t : quilt::to(t, device); });
  return *this;
}

void Module::zero_grad(bool set_to_none) {
  NoGradGuard ng;
  for (Tensor& p : parameters()) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none) p.set_grad(Tensor());
    else g.zero_();
  }
}

// ---- hooks ----

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook) {
  const uint64_t id = g_next_hook_id.fetch_add(1);
  pre_hooks_.emplace_back(id, std::move(hook));
  return {id};
}

HookHandle Module::register_forward_hook(ForwardHook hook) {
  const uint64_t id = g_next_hook_id.fetch_add(1);
  post_hooks_.emplace_back(id, std::move(hook));
  return {id};
}

bool Module::remove_hook(HookHandle handle) {
  auto drop = [&](auto& hooks) {
    for (auto it = hooks.begin(); it != hooks.end(); ++it)
      if (it->first == handle.id) {
        hooks.erase(it);
        return true;
      }
    return false;
  };
  return drop(pre_hooks_) || drop(post_hooks_);
}

// ---- printing ----

std::string Module::str() const {
  std::ostringstream os;
  os << type_name_ << '(' << extra_repr();
  if (!children_.empty()) {
    os << '\n';
    for (const auto& [n, c] : children_) {
      std::string child = c->str();
      // Indent the child's lines by two spaces.
      std::string indented;
      for (char ch : child) {
        indented += ch;
        if (ch == '\n') indented += "  ";
      }
      os << "  (" << n << "): " << indented << '\n';
    }
  }
  os << ')';
  return os.str();
}

}  // namespace quilt
