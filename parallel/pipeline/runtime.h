// The pipeline runtime: runs one pipeline rank's lowered action list (schedule.h) over the
// stages this rank holds, for one step's micro-batches. Forwards keep their input and output
// until the micro-batch's backward; sends and receives are asynchronous (a receive is waited on
// where its tensor is first needed; every send before the step returns), each tensor preceded
// by its shape, so micro-batches of different lengths pass; two stages on one rank hand tensors
// over directly. The last stage computes each micro-batch's loss. A stage's gradient
// synchronisation (FSDP, DDP) is switched on only for its last backward of the step.
//
//   Lowered lists = lower(make_schedule("1f1b", pp, m));
//   PipelineRunner runner(lists, pp_comm, {{.stage = s, .forward = fwd, .dp = dp}}, n_stages, loss_fn);
//   double loss_sum = runner.run(microbatches);   // last stage: sum of the losses; others: 0
#pragma once

#include <cstdlib>
#include <functional>
#include <map>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communicator.h"
#include "engine/autograd.h"
#include "parallel/data_parallel.h"
#include "parallel/pipeline/schedule.h"

namespace quilt::pipeline {

/// One stage held by this rank.
struct StageRef {
  int stage = 0;
  /// Tokens (first stage) or hidden states, positions and documents (undefined: one per row) ->
  /// hidden states, or logits on the last stage.
  std::function<Tensor(const Tensor& x, const Tensor& positions, const Tensor& document_ids)> forward;
  DataParallelism dp;  // the stage's gradient synchronisation, if any
};

/// A pipeline micro-batch: tokens (first stage), targets (last stage), positions and documents
/// (every stage; documents undefined unless rows are packed).
struct MicroBatch {
  Tensor tokens, targets, positions, document_ids;
};

/// One action as it ran: microseconds from the start of the step (which begins on every
/// pipeline rank at a barrier, so ranks' times line up). A span with microbatch -1 is a compute
/// waiting for its tensor from another rank.
struct Span {
  Action action;
  double start_us = 0, end_us = 0;
};

/// loss(logits, targets) of one micro-batch, as the gradients should see it (scaled).
using StageLoss = std::function<Tensor(const Tensor& logits, const Tensor& targets)>;

class PipelineRunner {
 public:
  /// `lists` is the lowered schedule of every rank; this rank is comm.rank() of the pipeline
  /// communicator `comm` (one rank per pipeline rank). Throws when `stages` are not the stages
  /// the schedule puts on this rank.
  PipelineRunner(Lowered lists, std::shared_ptr<Communicator> comm, std::vector<StageRef> stages, int num_stages,
                 StageLoss loss);
  /// Runs this rank's list over `mbs` (as many as the schedule's micro-batches); returns the
  /// sum of the last stage's micro-batch losses on the rank that holds it, 0 elsewhere. With
  /// `sync` false no stage synchronises gradients (an accumulation step before the last).
  double run(const std::vector<MicroBatch>& mbs, bool sync = true);
  /// The forwards (and their transfers) of the list only, without gradients: the loss sum as run().
  double evaluate(const std::vector<MicroBatch>& mbs);
  /// The stages of this rank, in the order given.
  const std::vector<StageRef>& stages() const { return stages_; }
  /// The rank that holds each stage.
  const std::vector<int>& stage_ranks() const { return ranks_; }
  /// Records the actions of the runs from now on (timed from a barrier at their start).
  void set_tracing(bool on) { tracing_ = on; }
  /// The actions of the last traced run, in the order they ran.
  const std::vector<Span>& trace() const { return trace_; }

 private:
  struct Slot {  // one stage's state for one micro-batch
    Tensor input;        // leaf (requires grad) unless this is the first stage
    Tensor output;       // the stage's output (loss on the last stage)
    Tensor grad_output;  // received from (or handed over by) the next stage
    DeferredBackward rest;  // after I, what W computes
    Work pending;           // a receive not yet waited on (into input or grad_output)
    std::vector<Work> sends;
    // A receive's shape header, posted at its RECV action without waiting; once it has come
    // (seen between actions, or waited for where the tensor is needed) the tensor's own
    // receive is posted into `pending`.
    Tensor header;
    Work header_pending;
    bool header_open = false;
    bool header_for_grad = false;
    int recv_peer = -1, recv_tag = 0;
  };
  StageRef& stage(int s);
  Slot& slot(int s, int m) { return slots_[{s, m}]; }
  void forward(const Action& a, const std::vector<MicroBatch>& mbs);
  void backward(const Action& a);
  void send(const Action& a);
  void recv(const Action& a, const std::vector<MicroBatch>& mbs);
  void post_tensor_recv(Slot& sl);           // after the header: the tensor's receive
  void advance_recvs();                      // posts the tensors of headers that have come
  void wait_received(Slot& sl);              // the slot's received tensor, waited for
  std::vector<std::pair<int, int>> open_headers_;  // (stage, micro-batch) of open headers
  int tag(const Action& a, bool header) const;

  double walk(const std::vector<MicroBatch>& mbs, bool backward, bool sync);
  Lowered lists_;
  std::shared_ptr<Communicator> comm_;
  Device device_;  // where the micro-batches of the running step are
  std::vector<StageRef> stages_;
  int num_stages_;
  StageLoss loss_;
  std::vector<int> ranks_;
  std::map<std::pair<int, int>, Slot> slots_;
  std::map<int, int> last_backward_;  // stage -> index in this rank's list of its last B or W
  int n_microbatches_ = 0;
  double loss_sum_ = 0;
  bool tracing_ = false;
  std::vector<Span> trace_;
  // Each activation or gradient goes out on a thread of its own that waits in MPI until it is
  // delivered (QUILT_PP_SEND_THREADS=0: posted and left, as other sends): MPI moves a large
  // message only while the sender is inside an MPI call, unless the transport can pull it
  // without the sender (shared memory with the kernel's single-copy path, which containers
  // often forbid; most networks need the sender too), and a pipeline sends and goes on
  // computing. pp 2, 12M Llama, single copy off: zero_bubble idles 13% instead of 34%.
  const bool send_threads_ = [] {
    const char* v = std::getenv("QUILT_PP_SEND_THREADS");
    return v == nullptr || std::string(v) != "0";
  }();
  std::mutex send_mu_;
  std::exception_ptr send_error_;
  std::vector<std::jthread> senders_;  // after what they use: joined first on destruction
  void finish_sends();  // joins the senders; rethrows the first failure
};

}  // namespace quilt::pipeline
