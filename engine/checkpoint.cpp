// Activation checkpointing as a composite Primitive: forward under no-grad keeping only the
// inputs; backward recomputes with grad on and runs a nested backward through the recomputation.
#include "engine/checkpoint.h"

#include "engine/autograd.h"
#include "engine/ops/binary.h"
#include "engine/ops/matmul.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/primitive.h"

namespace quilt {
namespace {

// The selective region this thread is in: recording linear outputs (first forward) or
// replaying them (recomputation). Nested checkpoints stack.
struct Selective {
  enum class Phase { record, replay } phase;
  std::vector<Tensor>* outputs;
  size_t next = 0;
};
thread_local std::vector<Selective> t_selective;

struct SelectiveScope {
  SelectiveScope(Selective::Phase phase, std::vector<Tensor>* outputs, bool on) : on_(on) {
    if (on_) t_selective.push_back({phase, outputs, 0});
  }
  ~SelectiveScope() {
    if (on_) t_selective.pop_back();
  }
  bool on_;
};

// Every region this thread is in, for checkpoint_keep(): recording each call's outputs (first
// forward) or replaying them (recomputation), in every mode.
struct Keep {
  Selective::Phase phase;
  std::vector<std::vector<Tensor>>* calls;
  size_t next = 0;
};
thread_local std::vector<Keep> t_keep;

struct KeepScope {
  KeepScope(Selective::Phase phase, std::vector<std::vector<Tensor>>* calls) { t_keep.push_back({phase, calls, 0}); }
  ~KeepScope() { t_keep.pop_back(); }
};

// A linear whose output is already known (kept by the first forward). Composite: its forward
// returns the kept tensor whatever the layout, and its backward — the gradients of x @ w^T +
// bias — runs ops, so distributed inputs route through the dispatcher there.
class KeptLinear final : public AnyDevicePrimitive {
 public:
  explicit KeptLinear(Tensor out) : out_(std::move(out)) {}
  const char* name() const override { return "kept_linear"; }
  bool composite() const override { return true; }
  std::vector<Tensor> forward_any(const std::vector<Tensor>&) override { return {out_.detach()}; }
  void save(const std::vector<Tensor>& in, const std::vector<Tensor>&) override {
    saved_ = {in[0].detach(), in[1].detach()};
    out_ = Tensor();
  }
  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    const Tensor& g = ctx.grads[0];
    const Tensor& x = saved_[0];
    const Tensor& w = saved_[1];
    Tensor gx, gw, gb;
    // The same products, in the same arrangement, as linear()'s own backward (x @ w^T through
    // matmul and transpose), so the gradients are bit-identical to an unkept linear's.
    if (ctx.needs[0]) gx = matmul(g, w);
    if (ctx.needs[1]) {
      const Tensor xt = x.dim() > 2 ? transpose(reshape(x, {-1, w.size(1)}), 0, 1) : transpose(x, -1, -2);
      const Tensor g2 = x.dim() > 2 ? reshape(g, {-1, w.size(0)}) : g;
      gw = transpose(sum_to(matmul(xt, g2), {w.size(1), w.size(0)}), 0, 1);
    }
    if (ctx.needs.size() > 2 && ctx.needs[2]) gb = sum_to(g, ctx.inputs[2].shape);
    return {gx, gw, gb};
  }

 private:
  Tensor out_;
};

class Checkpoint final : public AnyDevicePrimitive {
 public:
  // `anchored`: the last input is a placeholder leaf that only makes the node exist.
  Checkpoint(CheckpointFn fn, Generator* gen, bool anchored, CheckpointMode mode)
      : fn_(std::move(fn)), gen_(gen), anchored_(anchored), selective_(mode == CheckpointMode::save_matmuls) {}
  const char* name() const override { return "checkpoint"; }
  bool composite() const override { return true; }
  // The anchor leaf lives on the CPU whatever the user's inputs are on.
  Device device_of(const std::vector<Tensor>& in) const override { return common_device(name(), user_inputs(in)); }

  std::vector<Tensor> forward_any(const std::vector<Tensor>& in) override {
    counter_ = gen_->counter();
    NoGradGuard ng;
    SelectiveScope scope(Selective::Phase::record, &kept_, selective_);
    KeepScope keep(Selective::Phase::record, &kept_values_);
    std::vector<Tensor> outs = fn_(user_inputs(in));
    for (Tensor& o : outs) {
      QUILT_CHECK(o.defined(), "[checkpoint] the function returned an undefined tensor");
      // Fresh handles: the node must never take over a tensor fn returned as is (a parameter).
      o = o.detach();
    }
    return outs;
  }

  void save(const std::vector<Tensor>& in, const std::vector<Tensor>& out) override {
    const std::vector<Tensor> user = user_inputs(in);
    for (const Tensor& t : user) {
      saved_.push_back(t.defined() ? t.detach() : Tensor());
      wants_grad_.push_back(t.defined() && t.requires_grad());
    }
  }

  std::vector<Tensor> backward(const BackwardContext& ctx) override {
    // Recompute on fresh leaves that require grad as the originals did.
    std::vector<Tensor> leaves;
    for (size_t i = 0; i < saved_.size(); ++i) {
      Tensor x = saved_[i].defined() ? saved_[i].detach() : Tensor();
      if (wants_grad_[i]) x.set_requires_grad(true);
      leaves.push_back(x);
    }
    std::vector<Tensor> outs;
    {
      EnableGradGuard eg;
      const uint64_t now = gen_->counter();
      gen_->set_counter(counter_);
      try {
        SelectiveScope scope(Selective::Phase::replay, &kept_, selective_);
        KeepScope keep(Selective::Phase::replay, &kept_values_);
        outs = fn_(leaves);
        kept_.clear();
        kept_values_.clear();
      } catch (...) {
        gen_->set_counter(now);
        throw;
      }
      gen_->set_counter(now);  // later draws continue where the forward passes left them
    }
    QUILT_CHECK(outs.size() == ctx.outputs.size(), "[checkpoint] recomputation returned ", outs.size(),
                " tensors, the forward returned ", ctx.outputs.size());
    std::vector<Tensor> roots, seeds;
    for (size_t i = 0; i < outs.size(); ++i) {
      QUILT_CHECK(outs[i].defined() && outs[i].shape() == ctx.outputs[i].shape, "[checkpoint] recomputed output ", i,
                  " has shape ", outs[i].defined() ? outs[i].shape() : Shape{}, ", the forward had ",
                  ctx.outputs[i].shape, " (is the function deterministic?)");
      if (!outs[i].requires_grad()) continue;
      roots.push_back(outs[i]);
      const Tensor& g = ctx.grads[i];
      seeds.push_back(g.dtype() == outs[i].dtype() ? g : cast(g, outs[i].dtype()));
    }
    if (!roots.empty()) run_backward(roots, seeds, /*retain_graph=*/false, /*create_graph=*/false);
    std::vector<Tensor> grads;
    for (size_t i = 0; i < leaves.size(); ++i) grads.push_back(wants_grad_[i] ? leaves[i].grad() : Tensor());
    if (anchored_) grads.push_back(Tensor());
    return grads;
  }

 private:
  std::vector<Tensor> user_inputs(const std::vector<Tensor>& in) const {
    return anchored_ ? std::vector<Tensor>(in.begin(), in.end() - 1) : in;
  }

  CheckpointFn fn_;
  Generator* gen_;
  bool anchored_;
  bool selective_;
  std::vector<Tensor> kept_;  // save_matmuls: linear outputs of the first forward, in call order
  std::vector<std::vector<Tensor>> kept_values_;  // checkpoint_keep() outputs of the first forward, per call
  uint64_t counter_ = 0;
  std::vector<bool> wants_grad_;
};

}  // namespace

std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs, Generator* gen,
                               CheckpointMode mode) {
  QUILT_CHECK(static_cast<bool>(fn), "[checkpoint] got an empty function");
  if (!gen) gen = &default_generator();
  bool any_grad = false;
  for (const Tensor& t : inputs) any_grad = any_grad || (t.defined() && t.requires_grad());
  std::vector<Tensor> in = inputs;
  // Parameters used inside fn need the node even when no input requires grad (the first
  // block sees plain data): an empty leaf that requires grad makes apply() record it.
  const bool anchored = grad_enabled() && !any_grad;
  if (anchored) in.push_back(Tensor::empty({0}).set_requires_grad(true));
  return quilt::apply(std::make_shared<Checkpoint>(std::move(fn), gen, anchored, mode), in);
}

Tensor checkpoint(std::function<Tensor(const Tensor&)> fn, const Tensor& input, Generator* gen, CheckpointMode mode) {
  QUILT_CHECK(static_cast<bool>(fn), "[checkpoint] got an empty function");
  auto outs = checkpoint([f = std::move(fn)](const std::vector<Tensor>& in) { return std::vector<Tensor>{f(in[0])}; },
                         {input}, gen, mode);
  return outs.at(0);
}

Tensor checkpointable_linear(const Tensor& x, const Tensor& w, const Tensor& bias) {
  if (t_selective.empty()) return linear(x, w, bias);
  Selective& sel = t_selective.back();
  if (sel.phase == Selective::Phase::record) {
    Tensor y = linear(x, w, bias);
    sel.outputs->push_back(y.detach());
    return y;
  }
  QUILT_CHECK(sel.next < sel.outputs->size(), "[checkpoint] the recomputation ran more linear layers (",
              sel.next + 1, ") than the forward (", sel.outputs->size(), ")");
  Tensor kept = (*sel.outputs)[sel.next++];
  std::vector<Tensor> in = {x, w};
  if (bias.defined()) in.push_back(bias);
  return apply1(std::make_shared<KeptLinear>(kept), in);
}

std::vector<Tensor> checkpoint_keep(const std::function<std::vector<Tensor>()>& fn) {
  if (t_keep.empty()) return fn();
  Keep& k = t_keep.back();
  if (k.phase == Selective::Phase::record) {
    std::vector<Tensor> outs = fn();
    std::vector<Tensor>& kept = k.calls->emplace_back();
    for (const Tensor& t : outs) kept.push_back(t.defined() ? t.detach() : Tensor());
    return outs;
  }
  QUILT_CHECK(k.next < k.calls->size(), "[checkpoint] the recomputation asked for more kept values (call ", k.next + 1,
              ") than the forward kept (", k.calls->size(), " calls)");
  return (*k.calls)[k.next++];
}

bool in_checkpoint_recompute() { return !t_keep.empty() && t_keep.back().phase == Selective::Phase::replay; }

}  // namespace quilt
