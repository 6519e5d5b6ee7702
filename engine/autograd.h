// Reverse-mode autograd: a graph of Nodes built as ops run, walked backwards by backward().
// Grad mode is per thread (the threads backend runs ranks as threads).
//
//   { NoGradGuard g; w.add_(w.grad(), -lr); }      // optimizer updates are not recorded
//   auto gs = grad({loss}, {w});                    // gradients without touching .grad
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace quilt {

/// True when ops record the graph on this thread.
bool grad_enabled();
void set_grad_enabled(bool on);

/// RAII: disables graph recording on this thread.
class NoGradGuard {
 public:
  NoGradGuard() : prev_(grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

/// RAII: enables graph recording on this thread (inside a no-grad region).
class EnableGradGuard {
 public:
  EnableGradGuard() : prev_(grad_enabled()) { set_grad_enabled(true); }
  ~EnableGradGuard() { set_grad_enabled(prev_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

/// Where a node sends the gradient of one of its inputs.
struct Edge {
  std::shared_ptr<Node> fn;  // null: the input needs no gradient
  uint32_t input_nr = 0;
};

/// Shape/dtype/device of a tensor, kept to materialise zero gradients.
struct TensorMeta {
  Shape shape;
  DType dtype = DType::f32;
  Device device;
  std::shared_ptr<const DistSpec> dist;
};

/// A step of the backward graph: takes the gradients of an op's outputs, returns those of its inputs.
class Node {
 public:
  Node();
  virtual ~Node() = default;
  /// Gradients w.r.t. inputs (one per entry of `next`), given gradients w.r.t. outputs.
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) = 0;
  virtual std::string name() const = 0;
  /// Drops saved state once the graph is not retained.
  virtual void release() {}
  /// True when apply_some() computes only the gradients asked for (and so can be called again
  /// for the others while the graph is kept).
  virtual bool partial() const { return false; }
  /// Gradients w.r.t. the inputs `wanted` marks; the others may come back undefined. By
  /// default all of them (apply()).
  virtual std::vector<Tensor> apply_some(std::vector<Tensor>&& grad_outputs, const std::vector<bool>& wanted) {
    return apply(std::move(grad_outputs));
  }

  std::vector<Edge> next;          // one per input
  std::vector<TensorMeta> outputs;  // one per output
  std::vector<std::vector<GradHook>> output_hooks;  // per output: hooks on non-leaf tensors
  std::vector<bool> retain_output;  // per output: retain_grad() was called
  std::vector<std::weak_ptr<TensorImpl>> retained;  // per output, for retain_grad
  uint64_t sequence_nr;
};

/// Runs backward from `roots` with seed gradients `grads` (undefined = ones for a scalar).
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                  bool retain_graph, bool create_graph);

/// Gradients of `outputs` w.r.t. `inputs` (not accumulated into .grad); undefined where unreachable.
std::vector<Tensor> grad(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grad_outputs = {}, bool retain_graph = false,
                         bool create_graph = false);

/// What backward_inputs() leaves for backward_weights(): the ops whose gradients towards
/// anything but the inputs (weights) are still to be computed, and the gradients already
/// computed towards them.
struct DeferredBackward {
  struct Pending {
    std::shared_ptr<Node> node;
    std::vector<Tensor> grads;  // the node's output gradients (hooks already run)
    std::vector<bool> later;    // the input slots left for backward_weights
  };
  std::vector<Pending> pending;
  std::vector<std::pair<Edge, Tensor>> ready;
  bool retain_graph = false;
  bool empty() const { return pending.empty() && ready.empty(); }
};

/// The backward of `roots` split in two, as zero-bubble pipeline schedules need it:
/// backward_inputs runs only the ops on the way to `inputs` and accumulates their gradients
/// (their .grad, for leaves; read it from there), leaving the rest; backward_weights(rest) then
/// finishes the backward (weight gradients, their hooks). Each op's gradient work is done once
/// in all: an op that feeds both sides (a matmul of activations and a weight) computes its
/// input-side gradient in the first half and its weight-side gradient in the second. Together
/// they accumulate the same gradients as run_backward(roots, grads).
DeferredBackward backward_inputs(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                                 const std::vector<Tensor>& inputs, bool retain_graph = false);
void backward_weights(DeferredBackward&& rest);

/// The AccumulateGrad node of a leaf that requires grad (created on first use).
std::shared_ptr<Node> grad_accumulator(const Tensor& leaf);

/// Edge to which a gradient for `t` should flow (empty edge if t needs no grad).
Edge gradient_edge(const Tensor& t);

}  // namespace quilt
