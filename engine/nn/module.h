// Module: a node of a model tree holding parameters, buffers and child modules under
// HF-style dotted names ("layers.0.self_attn.q_proj.weight"), with forward hooks,
// train/eval mode, deterministic name-keyed initialisation and state dicts.
//
//   class Mlp : public Module {
//    public:
//     explicit Mlp(int64_t d) : Module("Mlp") {
//       up = register_module("up", std::make_shared<Linear>(d, 4 * d));
//       down = register_module("down", std::make_shared<Linear>(4 * d, d));
//     }
//     Tensor forward(const Tensor& x) override { return (*down)(gelu((*up)(x))); }
//     std::shared_ptr<Linear> up, down;
//   };
//   auto m = std::make_shared<Mlp>(64);
//   m->init_weights(/*seed=*/0);              // values depend on (seed, name, index) only
//   Tensor y = (*m)(x);                        // pre-hooks, forward, post-hooks
//
// A parameter's Tensor::name() is its dotted name from the topmost module, kept current as
// modules are registered into parents (and set again by init_weights()).
//
// Parameters live in slots owned by their module. register_parameter() returns a reference
// to the slot, which stays valid for the module's life; replace_parameter() (FSDP, TP, to())
// swaps the tensor inside the slot. So a module reads its parameters through the slot (or
// by name) and never keeps a copy of the handle, which a replacement would leave stale.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/ops/creation.h"
#include "engine/random.h"
#include "engine/tensor.h"

namespace quilt {

/// An insertion-ordered map from string keys (state dicts keep registration order).
template <class V>
class OrderedDict {
 public:
  using Item = std::pair<std::string, V>;

  /// Inserts `key` at the end, or overwrites its value in place if present.
  V& insert(const std::string& key, V value) {
    if (auto it = index_.find(key); it != index_.end()) return items_[it->second].second = std::move(value);
    index_.emplace(key, items_.size());
    items_.emplace_back(key, std::move(value));
    return items_.back().second;
  }
  bool contains(const std::string& key) const { return index_.count(key) != 0; }
  /// Pointer to the value of `key`, or nullptr.
  const V* find(const std::string& key) const {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items_[it->second].second;
  }
  V* find(const std::string& key) {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items_[it->second].second;
  }
  /// The value of `key`; throws naming the key when absent.
  const V& at(const std::string& key) const {
    const V* v = find(key);
    if (!v) fail("[OrderedDict] no key '", key, "'");
    return *v;
  }
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  /// Keys in insertion order.
  std::vector<std::string> keys() const {
    std::vector<std::string> k;
    k.reserve(items_.size());
    for (const auto& it : items_) k.push_back(it.first);
    return k;
  }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }
  auto begin() { return items_.begin(); }
  auto end() { return items_.end(); }

 private:
  std::vector<Item> items_;
  std::unordered_map<std::string, size_t> index_;
};

/// Name -> tensor in model order: parameters and persistent buffers.
using StateDict = OrderedDict<Tensor>;
/// (dotted name, tensor) pairs in registration order.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module;

/// Runs before forward; may replace the inputs (TP redistributes them, FSDP gathers parameters).
using ForwardPreHook = std::function<void(Module& module, std::vector<Tensor>& inputs)>;
/// Runs after forward; may replace the outputs.
using ForwardHook =
    std::function<void(Module& module, const std::vector<Tensor>& inputs, std::vector<Tensor>& outputs)>;

/// The body of a module's forward: inputs -> outputs.
using ForwardBody = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;
/// Runs a module's forward body its own way, inside the module's pre- and post-forward hooks
/// (activation checkpointing: `return checkpoint(body, inputs)`).
using ForwardWrapper = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs, const ForwardBody& body)>;

/// Identifies a registered hook, for remove_hook().
struct HookHandle {
  uint64_t id = 0;
};

/// Keys a non-strict load_state_dict() skipped.
struct LoadResult {
  std::vector<std::string> missing_keys;     // in the model, not in the dict
  std::vector<std::string> unexpected_keys;  // in the dict, not in the model
};

/// In-place initialisers. Random ones draw from Philox keyed by `key` at each element's global
/// index, so a shard of a distributed tensor gets exactly the values of the full tensor there.
namespace init {
/// Fills `t` with N(mean, std).
void normal_(Tensor& t, RngKey key, double mean = 0.0, double std = 1.0);
/// Fills `t` uniformly on [low, high).
void uniform_(Tensor& t, RngKey key, double low, double high);
/// Fills `t` with `value`.
void constant_(Tensor& t, double value);
inline void zeros_(Tensor& t) { constant_(t, 0.0); }
inline void ones_(Tensor& t) { constant_(t, 1.0); }

/// Where a distributed tensor's local shard sits in its global tensor (installed by dtensor/).
using GlobalViewResolver = std::function<GlobalView(const Tensor& t)>;
/// Installs the resolver the random initialisers use for distributed tensors.
void set_global_view_resolver(GlobalViewResolver fn);
}  // namespace init

/// RAII: while alive on this thread, modules register parameters without storage (shape,
/// dtype and name only). A model too big for one rank is built this way, sharded by
/// fully_shard (which allocates only this rank's shards), and then initialised with
/// init_weights, which fills each shard with exactly the values the full tensor has there.
class DeferredInitGuard {
 public:
  DeferredInitGuard();
  ~DeferredInitGuard();
  DeferredInitGuard(const DeferredInitGuard&) = delete;
  DeferredInitGuard& operator=(const DeferredInitGuard&) = delete;

 private:
  bool prev_;
};
/// True inside a DeferredInitGuard on this thread.
bool deferred_init_enabled();
/// True when `t` (or its local shard) has no storage: a parameter registered under DeferredInitGuard.
bool is_deferred(const Tensor& t);

/// Base of every layer and model. Not copyable; hold modules by std::shared_ptr.
class Module {
 public:
  /// `type_name` names the class in errors and printing ("Linear", "LlamaDecoderLayer").
  explicit Module(std::string type_name = "Module");
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& type_name() const { return type_name_; }

  // ---- forward ----
  /// The computation of a one-tensor module; the default throws (containers have none).
  virtual Tensor forward(const Tensor& x);
  /// Runs the forward pre-hooks, forward(x), then the forward hooks.
  Tensor operator()(const Tensor& x);

  // ---- registration ----
  /// Adds a parameter (a leaf; requires_grad as given) and returns its slot, which stays valid
  /// for the module's life. `value` may be undefined (an optional parameter, e.g. no bias).
  Tensor& register_parameter(const std::string& name, Tensor value, bool requires_grad = true);
  /// Adds a buffer (state that is not trained: masks, tables); non-persistent buffers are
  /// left out of state_dict().
  Tensor& register_buffer(const std::string& name, Tensor value, bool persistent = true);
  /// Adds a child module under `name` and returns it.
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> child) {
    add_child(name, child);
    return child;
  }

  // ---- traversal (registration order; own entries before children's) ----
  /// Parameters of this module (and its descendants when `recurse`), each once even when tied.
  std::vector<Tensor> parameters(bool recurse = true) const;
  /// (dotted name, parameter) pairs; a tied parameter appears once, under its first name.
  NamedTensors named_parameters(const std::string& prefix = "", bool recurse = true) const;
  /// (dotted name, buffer) pairs, persistent or not.
  NamedTensors named_buffers(const std::string& prefix = "", bool recurse = true) const;
  /// Direct children with their names.
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;
  /// This module (named `prefix`) and every descendant, depth first, parents before children.
  std::vector<std::pair<std::string, Module*>> named_modules(const std::string& prefix = "");
  /// Number of parameter elements (of the global tensors, for distributed parameters).
  int64_t num_parameters() const;

  // ---- lookup by dotted name ----
  /// The slot of the parameter at `dotted_name`; throws naming the name when absent.
  Tensor& parameter(const std::string& dotted_name);
  const Tensor& parameter(const std::string& dotted_name) const;
  /// The slot of the buffer at `dotted_name`; throws naming the name when absent.
  Tensor& buffer(const std::string& dotted_name);
  /// The descendant at `dotted_name` ("" is this module); throws naming the name when absent.
  Module& submodule(const std::string& dotted_name);
  bool has_parameter(const std::string& dotted_name) const;
  bool has_buffer(const std::string& dotted_name) const;
  /// Puts `value` into the parameter slot at `dotted_name` (FSDP/TP swap in shards; tying
  /// weights puts one tensor in two slots). The tensor is used as given (its requires_grad too);
  /// an unnamed one is named `dotted_name`.
  void replace_parameter(const std::string& dotted_name, Tensor value);
  /// Puts `value` into the buffer slot at `dotted_name`.
  void replace_buffer(const std::string& dotted_name, Tensor value);

  // ---- mode ----
  /// Sets training mode on this module and all descendants.
  void train(bool on = true);
  /// train(false).
  void eval() { train(false); }
  bool is_training() const { return training_; }
  /// Calls fn(dotted name, module) on this module ("") and every descendant, parents first.
  void apply(const std::function<void(const std::string& name, Module& module)>& fn);

  // ---- initialisation ----
  /// Initialises every parameter: the owning module's reset_parameter(local name, slot,
  /// RngKey(seed, full dotted name)). Call it on the root so names are the model's names.
  /// Also sets each parameter's Tensor::name() to its dotted name.
  void init_weights(uint64_t seed);
  /// Initialises one of this module's own parameters in place; the default throws, so every
  /// module with parameters says how they start.
  virtual void reset_parameter(const std::string& local_name, Tensor& param, RngKey key);

  // ---- state ----
  /// Parameters and persistent buffers by dotted name (tied tensors under each name), as
  /// detached handles sharing the module's storage.
  StateDict state_dict() const;
  /// Copies values in place (no graph). Throws one error listing every missing and unexpected
  /// key (when strict) and every shape or dtype mismatch (always); nothing is copied then.
  LoadResult load_state_dict(const StateDict& dict, bool strict = true);

  // ---- conversion ----
  /// Converts floating parameters and buffers to `dtype` (new tensors in the same slots; tied
  /// tensors stay tied; gradients are dropped).
  Module& to(DType dtype);
  /// Moves parameters and buffers to `device` (new tensors in the same slots).
  Module& to(Device device);
  /// Clears (or zero-fills) the .grad of every parameter.
  void zero_grad(bool set_to_none = true);

  // ---- hooks ----
  /// Adds a hook run before forward (in registration order).
  HookHandle register_forward_pre_hook(ForwardPreHook hook);
  /// Adds a hook run after forward (in registration order).
  HookHandle register_forward_hook(ForwardHook hook);
  /// Removes a hook; false if it was not registered here.
  bool remove_hook(HookHandle handle);
  /// Wraps this module's forward body (between its pre- and post-forward hooks); an empty
  /// wrapper removes it. A recomputation by the wrapper runs the body only, not the hooks.
  void set_forward_wrapper(ForwardWrapper wrapper) { wrapper_ = std::move(wrapper); }
  bool has_forward_wrapper() const { return static_cast<bool>(wrapper_); }

  // ---- printing ----
  /// The module tree, one line per module: "Mlp(\n  (up): Linear(in_features=64, ...)\n)".
  std::string str() const;
  /// Extra text inside this module's parentheses in str().
  virtual std::string extra_repr() const { return ""; }

 protected:
  /// Calls `body` between the forward pre-hooks and hooks: modules with other call
  /// signatures write their operator() as one line over this (adding `using
  /// Module::operator();` keeps the one-tensor call visible beside theirs).
  std::vector<Tensor> call_with_hooks(std::vector<Tensor> inputs,
                                      const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& body);

 private:
  struct Slot {
    std::string name;
    Tensor value;
    bool persistent = true;  // buffers only
  };
  // Visits (owner, local name, full dotted name, slot) for parameters or buffers.
  using SlotVisitor = std::function<void(Module& owner, const Slot& slot, const std::string& full, Tensor& value)>;
  void visit_slots(bool buffers, const std::string& prefix, bool recurse, const SlotVisitor& fn) const;
  void add_child(const std::string& name, std::shared_ptr<Module> child);
  Slot* find_slot(const std::string& dotted_name, bool buffer) const;
  void check_new_name(const std::string& name, const char* what) const;
  void replace_everywhere(const std::function<Tensor(const Tensor&)>& convert);

  // Dotted path of this module from the topmost module it hangs under ("" for a root).
  std::string path() const;

  std::string type_name_;
  bool training_ = true;
  Module* parent_ = nullptr;  // the module this one was last registered in (not owned)
  std::string name_in_parent_;
  std::vector<std::unique_ptr<Slot>> params_;
  std::vector<std::unique_ptr<Slot>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::vector<std::pair<uint64_t, ForwardPreHook>> pre_hooks_;
  std::vector<std::pair<uint64_t, ForwardHook>> post_hooks_;
  ForwardWrapper wrapper_;
};

}  // namespace quilt
