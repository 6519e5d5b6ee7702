// TrainStep: see train_step.h.
#include "tools/train_step.h"

#include "dtensor/dtensor.h"
#include "engine/engine.h"
#include "parallel/context_parallel.h"

namespace quilt {

Tensor causal_lm_loss(const Tensor& logits, const Tensor& targets, Reduction reduction) {
  Tensor l = logits;
  if (l.dtype() != DType::f32 && l.dtype() != DType::f64) l = cast(l, DType::f32);
  return cross_entropy(l.reshape({-1, l.size(-1)}), targets.reshape({-1}), -100, reduction);
}

Tensor default_positions(const Tensor& tokens) {
  const int64_t b = tokens.size(0), t = tokens.size(1);
  return arange(0, double(t)).unsqueeze(0).expand({b, t}).contiguous();
}

Batch context_parallel_batch(const Batch& b, int cp, int rank) {
  const int64_t rows = b.inputs.size(0), t = b.inputs.size(1);
  const Tensor positions = b.positions.defined() ? b.positions : default_positions(b.inputs);
  const Tensor docs = b.document_ids.defined() ? contiguous(cast(b.document_ids, DType::i64)) : Tensor();
  // Every row's indices into the flattened (B·T) batch, rows in order.
  std::vector<int64_t> flat;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int64_t> cu{0};  // documents: the runs of equal ids along the row
    if (docs.defined()) {
      const int64_t* ids = docs.data<int64_t>() + r * t;
      for (int64_t i = 1; i < t; ++i)
        if (ids[i] != ids[i - 1]) cu.push_back(i);
    }
    cu.push_back(t);
    for (int64_t i : cp_document_token_indices(cu, cp, rank)) flat.push_back(r * t + i);
  }
  auto shard = [&](const Tensor& x) {
    return x.defined() ? cp_shard_sequence(x.reshape({rows * t}), 0, flat).reshape({rows, -1}) : Tensor();
  };
  return {shard(b.inputs), shard(b.targets), shard(positions), shard(b.document_ids)};
}

// The batch on `device`, its positions made explicit (the default ones are built on the host).
Batch batch_on(const Batch& b, Device device) {
  if (device.is_cpu()) return b;
  auto move = [&](const Tensor& t) { return t.defined() ? t.to(device) : Tensor(); };
  return {move(b.inputs), move(b.targets), move(b.positions.defined() ? b.positions : default_positions(b.inputs)),
          move(b.document_ids)};
}

Tensor LocalTrainStep::loss_of(const Batch& host_batch) {
  const std::shared_ptr<Communicator>& cp = hooks_.cp_comm;
  if (!cp || cp->size() == 1) {
    const Batch b = batch_on(host_batch, hooks_.device);
    const Tensor positions = b.positions.defined() ? b.positions : default_positions(b.inputs);
    return causal_lm_loss(forward_(b.inputs, positions, b.document_ids), b.targets);
  }
  // This rank's share of every sequence (cut on the host, where the documents are read, then
  // moved). Its loss is cp · (its sum) / (the group's count), so that the mean over the cp ranks
  // (of losses, and of gradients under FSDP) is the sequence's mean loss, however the ignored
  // targets (packing's padding) fall between the ranks.
  const Batch mine = batch_on(context_parallel_batch(host_batch, cp->size(), cp->rank()), hooks_.device);
  Tensor count = sum(cast(ne(mine.targets, scalar_like(-100, mine.targets)), DType::f64));
  cp->all_reduce(count, ReduceOp::sum);
  const Tensor total =
      causal_lm_loss(forward_(mine.inputs, mine.positions, mine.document_ids), mine.targets, Reduction::sum);
  return total * (double(cp->size()) / count.item<double>());
}

namespace {

// The micro-batch losses' sum, in f64 on the model's device, in micro-batch order.
Tensor add_loss(const Tensor& sum, const Tensor& loss) {
  NoGradGuard ng;  // a record of the loss, not part of the graph
  const Tensor l = cast((loss.is_distributed() ? loss.local() : loss).detach(), DType::f64);
  return sum.defined() ? add(sum, l) : l;
}

// sum / count (0 for no micro-batches), as a 0-d f64 tensor.
Tensor mean_of(const Tensor& sum, size_t count, Device device) {
  NoGradGuard ng;
  if (!sum.defined()) return zeros({}, {.dtype = DType::f64, .device = device});
  return div(sum, scalar_like(double(count), sum));
}

}  // namespace

double LocalTrainStep::global_mean(const Tensor& local_mean) {
  Tensor t = local_mean.to(hooks_.loss_comm ? hooks_.loss_comm->device() : local_mean.device()).reshape({1}).clone();
  if (hooks_.loss_comm && hooks_.loss_comm->size() > 1) hooks_.loss_comm->all_reduce(t, ReduceOp::avg);
  return t.item<double>();
}

Tensor LocalTrainStep::run_local(const std::vector<Batch>& micro_batches) {
  const size_t n = micro_batches.size();
  Tensor sum;
  for (size_t m = 0; m < n; ++m) {
    // Gradients of all micro-batches but the last accumulate locally; the last one reduces.
    // (FSDP may instead reduce every micro-batch: defer_fsdp_grad_sync false.)
    const bool last = m + 1 == n;
    if (hooks_.dp.fsdp) hooks_.dp.fsdp->set_requires_gradient_sync(last || !hooks_.defer_fsdp_grad_sync);
    if (hooks_.dp.ddp) hooks_.dp.ddp->set_requires_gradient_sync(last);
    Tensor loss = loss_of(micro_batches[m]);
    (loss * (1.0 / double(n))).backward();
    hooks_.dp.finish_backward();
    sum = add_loss(sum, loss);
  }
  return mean_of(sum, n, hooks_.device);
}

double LocalTrainStep::run(const std::vector<Batch>& micro_batches) { return global_mean(run_local(micro_batches)); }

double LocalTrainStep::evaluate(const std::vector<Batch>& micro_batches) {
  NoGradGuard ng;
  Tensor sum;
  for (const Batch& b : micro_batches) sum = add_loss(sum, loss_of(b));
  return global_mean(mean_of(sum, micro_batches.size(), hooks_.device));
}

PipelineTrainStep::PipelineTrainStep(pipeline::Lowered lists, std::vector<pipeline::StageRef> stages, int num_stages,
                                     PipelineStepOptions opts)
    : opts_(std::move(opts)) {
  runner_ = std::make_unique<pipeline::PipelineRunner>(
      std::move(lists), opts_.pp_comm, std::move(stages), num_stages,
      [this](const Tensor& logits, const Tensor& targets) { return causal_lm_loss(logits, targets) * scale_; });
}

std::vector<pipeline::MicroBatch> PipelineTrainStep::cut(const Batch& b) const {
  const int64_t rows = b.inputs.size(0);
  QUILT_CHECK(rows % opts_.rows == 0, "[pipeline] a micro-batch of ", rows,
              " sequences does not divide into distributed.pipeline.pp_microbatch_size ", opts_.rows);
  std::vector<pipeline::MicroBatch> out;
  for (int64_t r = 0; r < rows; r += opts_.rows) {
    const Tensor tokens = b.inputs.narrow(0, r, opts_.rows).contiguous();
    auto rows_of = [&](const Tensor& t) { return t.defined() ? t.narrow(0, r, opts_.rows).contiguous() : Tensor(); };
    const Tensor positions = b.positions.defined() ? rows_of(b.positions) : default_positions(tokens);
    out.push_back({tokens, rows_of(b.targets), positions, rows_of(b.document_ids)});
  }
  return out;
}

// The last stage's loss sum, shared over the pipeline ranks, then averaged over the ranks that
// saw different tokens.
double PipelineTrainStep::shared_mean(double local_sum, size_t count) {
  Tensor t = scalar_tensor(local_sum / double(std::max<size_t>(1, count)), {.dtype = DType::f64});
  opts_.pp_comm->all_reduce(t, ReduceOp::sum);
  if (opts_.loss_comm && opts_.loss_comm->size() > 1) opts_.loss_comm->all_reduce(t, ReduceOp::avg);
  return t.item<double>();
}

double PipelineTrainStep::run(const std::vector<Batch>& micro_batches) {
  double sum = 0;
  size_t count = 0;
  for (size_t i = 0; i < micro_batches.size(); ++i) {
    const std::vector<pipeline::MicroBatch> mbs = cut(batch_on(micro_batches[i], opts_.device));
    const double n = double(mbs.size() * micro_batches.size());
    scale_ = opts_.scale_in_schedule ? 1.0 : 1.0 / n;
    // The runner sums the losses as the gradients saw them; undo the scaling for the mean.
    sum += runner_->run(mbs, /*sync=*/i + 1 == micro_batches.size()) / scale_;
    count += mbs.size();
  }
  if (opts_.scale_in_schedule) {
    const double n = double(count);
    for (const Tensor& p : opts_.params) {
      Tensor g = p.grad();
      if (g.defined()) (g.is_distributed() ? g.local() : g).mul_(1.0 / n);
    }
  }
  return shared_mean(sum, count);
}

double PipelineTrainStep::evaluate(const std::vector<Batch>& micro_batches) {
  double sum = 0;
  size_t count = 0;
  scale_ = 1;
  for (const Batch& b : micro_batches) {
    const std::vector<pipeline::MicroBatch> mbs = cut(batch_on(b, opts_.device));
    sum += runner_->evaluate(mbs);
    count += mbs.size();
  }
  return shared_mean(sum, count);
}

}  // namespace quilt
