// The pipeline runtime: see runtime.h.
#include "parallel/pipeline/runtime.h"

#include <algorithm>
#include <chrono>

#include "engine/engine.h"

namespace quilt::pipeline {
namespace {

constexpr int kMaxDims = 6;

Tensor plain(const Tensor& t) { return t.is_distributed() ? t.local() : t; }

}  // namespace

PipelineRunner::PipelineRunner(Lowered lists, std::shared_ptr<Communicator> comm, std::vector<StageRef> stages,
                               int num_stages, StageLoss loss)
    : lists_(std::move(lists)), comm_(std::move(comm)), stages_(std::move(stages)), num_stages_(num_stages),
      loss_(std::move(loss)) {
  QUILT_CHECK(int(lists_.size()) == comm_->size(), "[pipeline] the schedule has ", lists_.size(),
              " ranks but the pipeline communicator ", comm_->size());
  // Transfers are matched by tag (a header, then its tensor; micro-batches in schedule order,
  // which need not be the order a peer sends them in): NCCL matches a pair's messages by order.
  QUILT_CHECK(comm_->backend() != "nccl", "[pipeline] the runner matches its transfers by tag, which the nccl "
              "backend's point-to-point does not: give it a host (mpi) communicator for the pp axis (GPU tensors "
              "are staged through host memory)");
  ranks_ = pipeline::stage_ranks(lists_);
  QUILT_CHECK(int(ranks_.size()) == num_stages_, "[pipeline] the schedule has ", ranks_.size(), " stages, the model ",
              num_stages_);
  const int me = comm_->rank();
  std::vector<int> mine, given;
  for (int s = 0; s < num_stages_; ++s)
    if (ranks_[size_t(s)] == me) mine.push_back(s);
  for (const StageRef& st : stages_) given.push_back(st.stage);
  std::sort(given.begin(), given.end());
  QUILT_CHECK(mine == given, "[pipeline] rank ", me, " holds stages ", given, " but the schedule puts ", mine, " there");
  for (const auto& list : lists_)
    for (const Action& a : list) n_microbatches_ = std::max(n_microbatches_, a.microbatch + 1);
  const auto& list = lists_[size_t(me)];
  for (size_t i = 0; i < list.size(); ++i)
    if (list[i].op == Op::kB || list[i].op == Op::kW) last_backward_[list[i].stage] = int(i);
}

StageRef& PipelineRunner::stage(int s) {
  for (StageRef& st : stages_)
    if (st.stage == s) return st;
  fail("[pipeline] rank ", comm_->rank(), " has no stage ", s);
}

// Activations are keyed by the stage that consumes them, gradients likewise; a header and the
// data of one transfer get consecutive tags.
int PipelineRunner::tag(const Action& a, bool header) const {
  const bool grad = a.op == Op::kSendB || a.op == Op::kRecvB;
  const int consumer = a.op == Op::kSendF ? a.stage + 1 : a.op == Op::kSendB ? a.stage - 1 : a.stage;
  return (((grad ? 1 : 0) * num_stages_ + consumer) * n_microbatches_ + a.microbatch) * 2 + (header ? 1 : 0);
}

double PipelineRunner::run(const std::vector<MicroBatch>& mbs, bool sync) { return walk(mbs, true, sync); }

double PipelineRunner::evaluate(const std::vector<MicroBatch>& mbs) {
  NoGradGuard no_grad;
  return walk(mbs, false, false);
}

double PipelineRunner::walk(const std::vector<MicroBatch>& mbs, bool with_backward, bool sync) {
  QUILT_CHECK(int(mbs.size()) == n_microbatches_, "[pipeline] the schedule runs ", n_microbatches_,
              " micro-batches, got ", mbs.size());
  slots_.clear();
  loss_sum_ = 0;
  // Received tensors go where the micro-batches are (the stages run there).
  device_ = mbs.empty() ? Device::cpu() : mbs[0].positions.defined() ? mbs[0].positions.device() : mbs[0].tokens.device();
  const auto& list = lists_[size_t(comm_->rank())];
  using Clock = std::chrono::steady_clock;
  Clock::time_point t0;
  if (tracing_) {
    trace_.clear();
    comm_->barrier();
    t0 = Clock::now();
  }
  auto us = [&t0] { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); };
  open_headers_.clear();
  for (size_t i = 0; i < list.size(); ++i) {
    const Action& a = list[i];
    advance_recvs();
    const bool grad_side = a.op == Op::kB || a.op == Op::kI || a.op == Op::kW || a.op == Op::kSendB || a.op == Op::kRecvB;
    if (grad_side && !with_backward) continue;
    if (a.op == Op::kB || a.op == Op::kW)
      stage(a.stage).dp.set_requires_gradient_sync(sync && last_backward_[a.stage] == int(i));
    double start = 0;
    if (tracing_) {
      // A compute's wait for a tensor from another rank is idle time: traced apart from it.
      const bool needs_recv = (a.op == Op::kF && a.stage > 0 && ranks_[size_t(a.stage - 1)] != comm_->rank()) ||
                              ((a.op == Op::kB || a.op == Op::kI) && a.stage < num_stages_ - 1 &&
                               ranks_[size_t(a.stage + 1)] != comm_->rank());
      const double wait_start = us();
      if (needs_recv) wait_received(slot(a.stage, a.microbatch));
      start = us();
      if (start - wait_start > 1) trace_.push_back({Action{a.stage, Op::kRecvF, -1}, wait_start, start});
    }
    switch (a.op) {
      case Op::kF: forward(a, mbs); break;
      case Op::kB: case Op::kI: case Op::kW: backward(a); break;
      case Op::kSendF: case Op::kSendB: send(a); break;
      case Op::kRecvF: case Op::kRecvB: recv(a, mbs); break;
    }
    if (tracing_) trace_.push_back({a, start, us()});
  }
  for (auto& [key, sl] : slots_)
    for (Work& w : sl.sends) w.wait();
  finish_sends();
  slots_.clear();
  return loss_sum_;
}

void PipelineRunner::forward(const Action& a, const std::vector<MicroBatch>& mbs) {
  Slot& sl = slot(a.stage, a.microbatch);
  const MicroBatch& mb = mbs[size_t(a.microbatch)];
  Tensor x;
  if (a.stage == 0) {
    x = mb.tokens;
  } else if (ranks_[size_t(a.stage - 1)] == comm_->rank()) {
    // The previous stage is here: its output, cut from its graph, is this stage's input.
    x = slot(a.stage - 1, a.microbatch).output.detach().set_requires_grad(true);
    sl.input = x;
  } else {
    wait_received(sl);
    QUILT_CHECK(sl.input.defined(), "[pipeline] rank ", comm_->rank(), " runs ", to_string(a),
                " before receiving its input");
    x = sl.input.set_requires_grad(true);
  }
  Tensor out = stage(a.stage).forward(x, mb.positions, mb.document_ids);
  if (a.stage == num_stages_ - 1) {
    out = loss_(out, mb.targets);
    loss_sum_ += plain(out).item<double>();
  }
  sl.output = out;
}

void PipelineRunner::backward(const Action& a) {
  Slot& sl = slot(a.stage, a.microbatch);
  if (a.op == Op::kW) {
    backward_weights(std::move(sl.rest));
    stage(a.stage).dp.finish_backward();
    sl.output = Tensor();
    return;
  }
  std::vector<Tensor> seeds;
  if (a.stage != num_stages_ - 1) {
    if (ranks_[size_t(a.stage + 1)] == comm_->rank()) {
      sl.grad_output = slot(a.stage + 1, a.microbatch).input.grad();
    } else {
      wait_received(sl);
      QUILT_CHECK(sl.grad_output.defined(), "[pipeline] rank ", comm_->rank(), " runs ", to_string(a),
                  " before receiving its output's gradient");
    }
    seeds.push_back(sl.grad_output);
  }
  if (a.op == Op::kB) {
    run_backward({sl.output}, seeds, false, false);
    stage(a.stage).dp.finish_backward();
    sl.output = Tensor();
  } else {
    std::vector<Tensor> inputs;
    if (sl.input.defined()) inputs.push_back(sl.input);
    sl.rest = backward_inputs({sl.output}, seeds, inputs);
  }
  sl.grad_output = Tensor();
}

void PipelineRunner::send(const Action& a) {
  Slot& sl = slot(a.stage, a.microbatch);
  const bool grad = a.op == Op::kSendB;
  const Tensor t = plain(grad ? sl.input.grad() : sl.output).detach().contiguous();
  QUILT_CHECK(t.defined(), "[pipeline] rank ", comm_->rank(), " has nothing to send at ", to_string(a));
  QUILT_CHECK(t.dim() <= kMaxDims, "[pipeline] cannot send a tensor of ", t.dim(), " dims at ", to_string(a));
  const int peer = ranks_[size_t(grad ? a.stage - 1 : a.stage + 1)];
  std::vector<double> head(kMaxDims + 2, 0);
  head[0] = double(int(t.dtype()));
  head[1] = double(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) head[size_t(d + 2)] = double(t.size(d));
  const Tensor header = from_vector(head, {kMaxDims + 2}, {.dtype = DType::i64});
  sl.sends.push_back(comm_->send(header, peer, tag(a, true), true));
  // (MPI host tensors only: a GPU tensor's staging copy belongs on this thread's stream.)
  if (!send_threads_ || comm_->backend() != "mpi" || t.device().is_cuda()) {
    sl.sends.push_back(comm_->send(t, peer, tag(a, false), true));
    return;
  }
  senders_.emplace_back([this, comm = comm_, t, peer, tg = tag(a, false)] {
    try {
      comm->send(t, peer, tg, true).wait();
    } catch (...) {
      std::lock_guard lk(send_mu_);
      if (!send_error_) send_error_ = std::current_exception();
    }
  });
}

void PipelineRunner::finish_sends() {
  senders_.clear();  // joins
  std::exception_ptr e;
  {
    std::lock_guard lk(send_mu_);
    std::swap(e, send_error_);
  }
  if (e) std::rethrow_exception(e);
}

void PipelineRunner::recv(const Action& a, const std::vector<MicroBatch>&) {
  Slot& sl = slot(a.stage, a.microbatch);
  const bool grad = a.op == Op::kRecvB;
  const int peer = ranks_[size_t(grad ? a.stage + 1 : a.stage - 1)];
  // The shape first (micro-batches may differ in length), then the tensor. Neither is waited
  // for here: a blocking header receive would hold this rank at its RECV until the peer reached
  // its SEND (pp 2, 12M Llama, zero_bubble: 40% idle instead of 7% where the transfer is slow).
  sl.header = zeros({kMaxDims + 2}, {.dtype = DType::i64});
  sl.header_pending = comm_->recv(sl.header, peer, tag(a, true), true);
  sl.header_open = true;
  sl.header_for_grad = grad;
  sl.recv_peer = peer;
  sl.recv_tag = tag(a, false);
  open_headers_.emplace_back(a.stage, a.microbatch);
}

void PipelineRunner::post_tensor_recv(Slot& sl) {
  sl.header_pending.wait();
  sl.header_open = false;
  const int64_t* h = sl.header.data<int64_t>();
  Shape shape(h + 2, h + 2 + h[1]);
  Tensor t = empty(shape, {.dtype = DType(h[0]), .device = device_});
  sl.pending = comm_->recv(t, sl.recv_peer, sl.recv_tag, true);
  (sl.header_for_grad ? sl.grad_output : sl.input) = t;
}

void PipelineRunner::advance_recvs() {
  size_t keep = 0;
  for (const auto& key : open_headers_) {
    Slot& sl = slot(key.first, key.second);
    if (sl.header_open && sl.header_pending.is_completed()) post_tensor_recv(sl);
    if (sl.header_open) open_headers_[keep++] = key;
  }
  open_headers_.resize(keep);
}

void PipelineRunner::wait_received(Slot& sl) {
  if (sl.header_open) post_tensor_recv(sl);
  sl.pending.wait();
}

}  // namespace quilt::pipeline
