// TrainStep: see train_step.h.
#include "tools/train_step.h"

#include "dtensor/dtensor.h"
#include "engine/engine.h"

namespace quilt {

Tensor causal_lm_loss(const Tensor& logits, const Tensor& targets) {
  Tensor l = logits;
  if (l.dtype() != DType::f32 && l.dtype() != DType::f64) l = cast(l, DType::f32);
  return cross_entropy(l.reshape({-1, l.size(-1)}), targets.reshape({-1}));
}

Tensor default_positions(const Tensor& tokens) {
  const int64_t b = tokens.size(0), t = tokens.size(1);
  return arange(0, double(t)).unsqueeze(0).expand({b, t}).contiguous();
}

Tensor LocalTrainStep::loss_of(const Batch& b) {
  return causal_lm_loss(forward_(b.inputs, default_positions(b.inputs)), b.targets);
}

double LocalTrainStep::global_mean(double local_sum, size_t count) {
  Tensor t = scalar_tensor(local_sum / double(std::max<size_t>(1, count)), {.dtype = DType::f64});
  if (hooks_.loss_comm && hooks_.loss_comm->size() > 1) hooks_.loss_comm->all_reduce(t, ReduceOp::avg);
  return t.item<double>();
}

double LocalTrainStep::run(const std::vector<Batch>& micro_batches) {
  const size_t n = micro_batches.size();
  double sum = 0;
  for (size_t m = 0; m < n; ++m) {
    // Gradients of all micro-batches but the last accumulate locally; the last one reduces.
    // (FSDP may instead reduce every micro-batch: defer_fsdp_grad_sync false.)
    const bool last = m + 1 == n;
    if (hooks_.dp.fsdp) hooks_.dp.fsdp->set_requires_gradient_sync(last || !hooks_.defer_fsdp_grad_sync);
    if (hooks_.dp.ddp) hooks_.dp.ddp->set_requires_gradient_sync(last);
    Tensor loss = loss_of(micro_batches[m]);
    (loss * (1.0 / double(n))).backward();
    hooks_.dp.finish_backward();
    sum += (loss.is_distributed() ? loss.local() : loss).item<double>();
  }
  return global_mean(sum, n);
}

double LocalTrainStep::evaluate(const std::vector<Batch>& micro_batches) {
  NoGradGuard ng;
  double sum = 0;
  for (const Batch& b : micro_batches) {
    Tensor loss = loss_of(b);
    sum += (loss.is_distributed() ? loss.local() : loss).item<double>();
  }
  return global_mean(sum, micro_batches.size());
}

}  // namespace quilt
