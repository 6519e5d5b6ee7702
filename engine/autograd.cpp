// The backward engine: discovers the graph reachable from the roots, counts dependencies,
// and runs nodes in reverse creation order once all their gradients have arrived.
#include "engine/autograd.h"

#include <atomic>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "engine/ops/binary.h"
#include "engine/ops/creation.h"
#include "engine/ops/view.h"

namespace quilt {
namespace {

thread_local bool t_grad_enabled = true;
std::atomic<uint64_t> g_sequence{0};

// Adds `g` into a gradient slot (first arrival is taken as is).
void accumulate_into(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  slot = slot.defined() ? add(slot, g) : g;
}

class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {
    outputs.push_back(TensorMeta{leaf_->shape, leaf_->dtype, leaf_->storage.device(), leaf_->dist});
    output_hooks.resize(1);
    retain_output.resize(1);
    retained.resize(1);
  }
  std::string name() const override { return "AccumulateGrad"; }
  // The leaf's tensor hooks, in order (also run when grad() captures this leaf's gradient).
  Tensor run_hooks(Tensor g) {
    for (auto& h : leaf_->meta().hooks) {
      Tensor r = h(g);
      if (r.defined()) g = r;
    }
    return g;
  }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    Tensor g = grads[0];
    if (!g.defined()) return {};
    Tensor leaf(leaf_);
    AutogradMeta& m = leaf_->meta();
    g = run_hooks(g);
    QUILT_CHECK(g.shape() == leaf_->shape, "[backward] gradient of shape ", g.shape(), " for leaf '",
                leaf_->name, "' of shape ", leaf_->shape);
    if (g.dtype() != leaf_->dtype) g = cast(g, leaf_->dtype);
    if (!m.grad) {
      if (grad_enabled()) {
        m.grad = g.impl_ptr();  // create_graph: keep the gradient's own graph
      } else {
        // Take ownership when no other tensor can see these bytes; otherwise copy, so
        // later in-place accumulation cannot write into another tensor.
        const bool sole = !g.is_distributed() && g.is_contiguous() && g.offset() == 0 &&
                          g.impl_ptr().use_count() <= 2 && g.storage().use_count() == 1 &&
                          g.storage().nbytes() == g.nbytes();
        m.grad = (sole ? g.detach() : clone(g.detach())).impl_ptr();
      }
    } else if (grad_enabled()) {
      m.grad = add(Tensor(m.grad), g).impl_ptr();
    } else {
      Tensor(m.grad).add_(g);
    }
    for (auto& h : m.post_accumulate_hooks) h(leaf);
    return {};
  }

 private:
  std::shared_ptr<TensorImpl> leaf_;
};

struct ReadyCmp {
  bool operator()(const Node* a, const Node* b) const { return a->sequence_nr < b->sequence_nr; }
};

}  // namespace

bool grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool on) { t_grad_enabled = on; }

Node::Node() : sequence_nr(g_sequence.fetch_add(1)) {}

std::shared_ptr<Node> grad_accumulator(const Tensor& leaf) {
  QUILT_CHECK(leaf.is_leaf() && leaf.requires_grad(), "[autograd] grad_accumulator of a non-leaf or a tensor not requiring grad");
  AutogradMeta& m = leaf.unsafe_impl()->meta();
  // Threads of one process (the threads backend's ranks) may record ops on one shared leaf at
  // once: without the lock two of them write its weak_ptr together.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (auto acc = m.grad_accumulator.lock()) return acc;
  auto acc = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
  m.grad_accumulator = acc;
  return acc;
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (!t.is_leaf()) return Edge{t.grad_fn(), t.output_nr()};
  return Edge{grad_accumulator(t), 0};
}

namespace {

// The gradient seeds of `roots` (ones for a scalar root without one).
std::vector<std::pair<Edge, Tensor>> start_edges(const std::vector<Tensor>& roots, const std::vector<Tensor>& seeds) {
  QUILT_CHECK(roots.size() == seeds.size() || seeds.empty(), "[backward] ", roots.size(), " outputs but ",
              seeds.size(), " gradients");
  std::vector<std::pair<Edge, Tensor>> starts;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    QUILT_CHECK(r.defined() && r.requires_grad(), "[backward] output ", i,
                " does not require grad (no input of its graph requires grad)");
    Tensor seed = seeds.empty() ? Tensor() : seeds[i];
    if (!seed.defined()) {
      QUILT_CHECK(r.numel() == 1, "[backward] a gradient must be given for a non-scalar output of shape ", r.shape());
      seed = ones_like(r.detach());
    }
    QUILT_CHECK(seed.shape() == r.shape(), "[backward] gradient shape ", seed.shape(), " differs from output shape ",
                r.shape());
    starts.emplace_back(gradient_edge(r), seed);
  }
  return starts;
}

// A backward restricted to the nodes on a path to `targets` (backward_inputs); what the others
// still need is left in `rest`.
struct Split {
  std::vector<Node*> targets;
  DeferredBackward* rest = nullptr;
};

// Shared by backward(), grad() and the split backward: `capture` maps (node, slot) to a result
// index; when set, leaves are not accumulated into.
std::vector<Tensor> execute(std::vector<std::pair<Edge, Tensor>> starts, bool retain_graph, bool create_graph,
                            const std::vector<Edge>* capture, const Split* split = nullptr) {
  std::unordered_map<Node*, int> deps;
  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  std::unordered_map<Node*, std::shared_ptr<Node>> keep;  // holds nodes alive while we run

  // Discover the graph and count incoming edges.
  std::vector<Node*> stack;
  std::unordered_map<Node*, std::vector<Node*>> parents;  // only for a split
  for (auto& [e, g] : starts)
    if (keep.emplace(e.fn.get(), e.fn).second) stack.push_back(e.fn.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next) {
      if (!e.fn) continue;
      ++deps[e.fn.get()];
      if (split) parents[e.fn.get()].push_back(n);
      if (keep.emplace(e.fn.get(), e.fn).second) stack.push_back(e.fn.get());
    }
  }
  // A split runs the nodes from which a target can be reached, i.e. the targets and, going up
  // the graph, their parents; the rest waits for backward_weights.
  std::unordered_set<Node*> on_path;
  if (split) {
    std::vector<Node*> up;
    for (Node* t : split->targets)
      if (keep.count(t) && on_path.insert(t).second) up.push_back(t);
    while (!up.empty()) {
      Node* n = up.back();
      up.pop_back();
      for (Node* p : parents[n])
        if (on_path.insert(p).second) up.push_back(p);
    }
    for (auto& [n, count] : deps)
      if (!on_path.count(n)) count = -2;  // never runs in this pass
  }
  auto runs_here = [&](Node* n) { return !split || on_path.count(n) > 0; };

  std::unordered_map<Node*, std::vector<std::pair<uint32_t, size_t>>> captures;
  std::vector<Tensor> captured;
  if (capture) {
    captured.resize(capture->size());
    for (size_t i = 0; i < capture->size(); ++i)
      if ((*capture)[i].fn) captures[(*capture)[i].fn.get()].push_back({(*capture)[i].input_nr, i});
  }

  for (auto& [e, g] : starts) {
    if (!runs_here(e.fn.get())) {
      split->rest->ready.emplace_back(e, g);
      continue;
    }
    auto& buf = buffers[e.fn.get()];
    buf.resize(e.fn->outputs.size());
    accumulate_into(buf[e.input_nr], g);
  }

  std::priority_queue<Node*, std::vector<Node*>, ReadyCmp> ready;
  for (auto& [e, g] : starts)
    if (runs_here(e.fn.get()) && deps[e.fn.get()] == 0) { ready.push(e.fn.get()); deps[e.fn.get()] = -1; }

  std::optional<NoGradGuard> no_grad;
  std::optional<EnableGradGuard> with_grad;
  if (create_graph) with_grad.emplace(); else no_grad.emplace();

  while (!ready.empty()) {
    Node* n = ready.top();
    ready.pop();
    std::vector<Tensor> grads = std::move(buffers[n]);
    buffers.erase(n);
    grads.resize(n->outputs.size());
    const bool is_leaf_acc = n->name() == "AccumulateGrad";
    for (size_t i = 0; i < grads.size() && !is_leaf_acc; ++i) {
      if (!grads[i].defined()) continue;
      for (auto& h : n->output_hooks[i]) {
        Tensor r = h(grads[i]);
        if (r.defined()) grads[i] = r;
      }
      if (n->retain_output[i]) {
        if (auto impl = n->retained[i].lock()) {
          Tensor t(impl);
          Tensor old = t.grad();
          t.set_grad(old.defined() ? add(old, grads[i]) : grads[i].detach());
        }
      }
    }
    if (capture && is_leaf_acc && !grads.empty() && grads[0].defined())
      grads[0] = static_cast<AccumulateGrad*>(n)->run_hooks(grads[0]);  // grad() sees hooked leaf gradients too
    if (auto it = captures.find(n); it != captures.end())
      for (auto [slot, idx] : it->second) accumulate_into(captured[idx], grads[slot]);

    // In a split, the slots towards nodes off the path are left for backward_weights: a
    // partial node computes them then (keeping its saved tensors), any other computes them now.
    std::vector<bool> later(n->next.size(), false);
    bool defer = false;
    if (split)
      for (size_t i = 0; i < n->next.size(); ++i)
        if (n->next[i].fn && !on_path.count(n->next[i].fn.get())) later[i] = defer = true;
    std::vector<Tensor> outs;
    if (defer && n->partial()) {
      std::vector<bool> now(later.size());
      for (size_t i = 0; i < later.size(); ++i) now[i] = !later[i];
      split->rest->pending.push_back({keep.at(n), grads, later});
      outs = n->apply_some(std::move(grads), now);
    } else {
      if (!(capture && is_leaf_acc)) outs = n->apply(std::move(grads));
      if (!retain_graph) n->release();
      if (defer)
        for (size_t i = 0; i < later.size(); ++i)
          if (later[i] && i < outs.size() && outs[i].defined()) split->rest->ready.emplace_back(n->next[i], outs[i]);
    }
    for (size_t i = 0; i < n->next.size(); ++i) {
      const Edge& e = n->next[i];
      if (!e.fn || later[i]) continue;
      Node* m = e.fn.get();
      if (i < outs.size() && outs[i].defined()) {
        auto& buf = buffers[m];
        buf.resize(m->outputs.size());
        accumulate_into(buf[e.input_nr], outs[i]);
      }
      if (--deps[m] == 0) ready.push(m);
    }
  }
  return captured;
}

}  // namespace

void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph,
                  bool create_graph) {
  execute(start_edges(roots, grads), retain_graph || create_graph, create_graph, nullptr);
}

std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs, bool retain_graph, bool create_graph) {
  std::vector<Edge> edges;
  for (const Tensor& t : inputs) {
    QUILT_CHECK(t.defined() && t.requires_grad(), "[grad] every input must require grad");
    edges.push_back(gradient_edge(t));
  }
  return execute(start_edges(outputs, grad_outputs), retain_graph || create_graph, create_graph, &edges);
}

DeferredBackward backward_inputs(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                                 const std::vector<Tensor>& inputs, bool retain_graph) {
  DeferredBackward rest;
  rest.retain_graph = retain_graph;
  Split split;
  split.rest = &rest;
  for (const Tensor& t : inputs) {
    QUILT_CHECK(t.defined() && t.requires_grad(), "[backward_inputs] every input must require grad");
    split.targets.push_back(gradient_edge(t).fn.get());
  }
  execute(start_edges(roots, grads), retain_graph, false, nullptr, &split);
  return rest;
}

void backward_weights(DeferredBackward&& rest) {
  std::vector<std::pair<Edge, Tensor>> starts = std::move(rest.ready);
  {
    NoGradGuard no_grad;
    for (DeferredBackward::Pending& p : rest.pending) {
      std::vector<Tensor> outs = p.node->apply_some(std::move(p.grads), p.later);
      if (!rest.retain_graph) p.node->release();
      for (size_t i = 0; i < p.later.size(); ++i)
        if (p.later[i] && i < outs.size() && outs[i].defined()) starts.emplace_back(p.node->next[i], outs[i]);
    }
  }
  rest.pending.clear();
  if (!starts.empty()) execute(std::move(starts), rest.retain_graph, false, nullptr);
}

}  // namespace quilt
