// Communicator: the one interface every parallelism talks through. Backends: MPI (host memory,
// device tensors staged through host buffers), NCCL (device memory, a communication stream) and
// an in-process threads backend (N ranks as N threads) for fast unit tests of the higher layers.
// Every call returns a Work; with async_op = false (the default) it has completed on return.
// Like the op itself, async_op must be the same on every rank (the MPI backend runs asynchronous
// collectives in MPI's nonblocking form, which never matches a blocking call of another rank).
//
//   init_from_launcher();                         // mpirun / srun / plain ./prog (one rank)
//   Communicator& comm = world();
//   comm.all_reduce(grad, ReduceOp::avg);         // blocking
//   Work w = comm.all_gather(full, shard, /*async_op=*/true);  ...  w.wait();
//   auto tp = comm.split(/*color=*/comm.rank() / 2, /*key=*/comm.rank());
//   run_threads_group(4, [](Communicator& c) { c.barrier(); });   // 4 ranks in one process
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace quilt {

namespace detail {
class WorkState;
struct OpCall;
struct QuickOp;
}  // namespace detail

/// How values from different ranks combine. avg is sum / world size (truncating for integers);
/// on bool tensors sum and max are logical or, min is logical and, avg is an error.
enum class ReduceOp : uint8_t { sum, avg, max, min };

/// "sum", "avg", "max", "min".
const char* reduce_op_name(ReduceOp op);

/// Settings of a communicator. Unset fields come from the environment, then the defaults:
/// QUILT_COMM_TIMEOUT_S (seconds, fractions allowed; default 600) and QUILT_COMM_DEBUG=1.
struct CommOptions {
  /// A collective that has not completed this long after it was issued aborts the job
  /// (MPI, NCCL) or throws an Error on every rank (threads).
  std::optional<std::chrono::milliseconds> timeout = std::nullopt;
  /// Before each collective, all ranks exchange the op, sequence number, shape and dtype and
  /// fail naming the first rank that differs (costs one small all-gather per collective).
  std::optional<bool> debug_checks = std::nullopt;
};

/// The timeout and debug flag `opts` resolves to (explicit, else environment, else default).
std::chrono::milliseconds resolved_timeout(const CommOptions& opts);
bool resolved_debug_checks(const CommOptions& opts);

/// Handle to an operation in flight. A default-constructed Work is already complete.
/// Output tensors hold their results once wait() has returned (on CUDA: for work queued on the
/// current stream after wait()).
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  /// Waits for completion and rethrows the op's error. Host backends block the calling thread;
  /// NCCL makes the current CUDA stream wait instead (the host does not block).
  void wait();
  /// Like wait() but gives up after `timeout` on host backends; false when not yet complete.
  bool wait_for(std::chrono::milliseconds timeout);
  /// True once the operation has finished (successfully or not); never blocks.
  bool is_completed() const;
  /// "all_reduce #5 on world (shape (4, 3), f32, sum)", or "no-op" (also the Work of a
  /// synchronous MPI collective, which carries no state: it ran inline and had completed).
  std::string describe() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

/// Waits for every work in order.
void wait_all(std::vector<Work>& works);

/// One operation of a batched group of point-to-point transfers (see Communicator::batch_p2p).
struct P2POp {
  enum class Kind : uint8_t { send, recv };
  Kind kind = Kind::send;
  Tensor tensor;  // sent from / received into
  int peer = 0;   // rank in the communicator
  int tag = 0;

  static P2POp send(Tensor t, int peer, int tag = 0) { return {Kind::send, std::move(t), peer, tag}; }
  static P2POp recv(Tensor t, int peer, int tag = 0) { return {Kind::recv, std::move(t), peer, tag}; }
};

/// A group of ranks that exchange tensors. Collectives must be called by every rank of the
/// group in the same order; each gets a sequence number (#1, #2, ... per communicator) that
/// errors and the watchdog name. Tensors may have any strides (non-contiguous ones go through a
/// contiguous copy) and any dtype; zero-size tensors are fine. A communicator is used from one
/// thread at a time; Works may be waited on from any thread.
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This process's (or thread's) rank in the group, 0 <= rank < size.
  int rank() const { return rank_; }
  /// Number of ranks in the group.
  int size() const { return size_; }
  /// "mpi", "nccl", "threads" or "local" (one rank, no launcher).
  const std::string& backend() const { return backend_; }
  /// Where its tensors live: CPU for mpi/threads (device tensors are staged), cuda:N for nccl.
  Device device() const { return device_; }
  /// "world", "world.split1[color 0]", ...: names the communicator in errors.
  const std::string& name() const { return *name_; }
  /// The mesh axis this communicator spans ("dp_shard", "tp", ...; "" when none was set).
  const std::string& axis() const { return axis_; }
  /// Labels the communicator with its mesh axis (traces show it beside the collective).
  void set_axis(std::string axis) { axis_ = std::move(axis); }
  /// Sequence number of the last collective issued on this communicator (0 before the first).
  uint64_t last_seq() const { return seq_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Changes the timeout for collectives issued from now on.
  void set_timeout(std::chrono::milliseconds t);
  bool debug_checks() const { return debug_; }
  /// Turns the per-collective consistency check on or off (every rank must agree).
  void set_debug_checks(bool on) { debug_ = on; }

  // ---- collectives ----
  /// t = op over ranks of t, on every rank (in place).
  Work all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum, bool async_op = false);
  /// t = root's t, on every rank (in place).
  Work broadcast(const Tensor& t, int root, bool async_op = false);
  /// On root, t = op over ranks of t; other ranks' t is left unchanged.
  Work reduce(const Tensor& t, int root, ReduceOp op = ReduceOp::sum, bool async_op = false);
  /// out = concatenation of every rank's `in` in rank order; out.numel() == size() * in.numel().
  Work all_gather(const Tensor& out, const Tensor& in, bool async_op = false);
  /// Variable-size all-gather along dim 0: rank r contributes rows[r] rows (in.size(0) on r);
  /// out has sum(rows) rows, the other dims equal in's.
  Work all_gather_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& rows, bool async_op = false);
  /// out = chunk `rank` of (op over ranks of in); in.numel() == size() * out.numel().
  Work reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op = ReduceOp::sum, bool async_op = false);
  /// Variable-size reduce-scatter along dim 0: rank r receives rows[r] rows of the reduced `in`
  /// (which has sum(rows) rows).
  Work reduce_scatter_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& rows,
                        ReduceOp op = ReduceOp::sum, bool async_op = false);
  /// All-to-all along dim 0 (the MoE token exchange): this rank sends in_splits[j] rows of `in`
  /// (in order) to rank j and receives out_splits[j] rows from rank j into `out` (in order).
  /// Empty split lists mean equal splits (the dim must then divide by size()); a call without
  /// splits must be made without them on every rank (as the MoE count exchange does), since the
  /// MPI backend then runs MPI_Alltoall, cheaper than MPI_Alltoallv for small blocks.
  Work all_to_all_single(const Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits = {},
                         const std::vector<int64_t>& in_splits = {}, bool async_op = false);
  /// Returns once every rank has called it.
  Work barrier(bool async_op = false);
  /// Sub-communicators: ranks with equal color form one, ordered by (key, rank). A negative
  /// color means "no group" and returns nullptr. Collective over this communicator.
  std::shared_ptr<Communicator> split(int color, int key);

  // ---- point to point ----
  /// Sends t to rank `peer`; matched in order with recvs of the same (source, tag) on the peer.
  Work send(const Tensor& t, int peer, int tag = 0, bool async_op = false);
  /// Receives into t (same numel and dtype as the matching send) from rank `peer`.
  Work recv(const Tensor& t, int peer, int tag = 0, bool async_op = false);
  /// Issues all sends and receives together (no ordering deadlock among them) as one Work.
  Work batch_p2p(const std::vector<P2POp>& ops, bool async_op = false);
  /// The same for a braced list, `batch_p2p({P2POp::send(a, next), P2POp::recv(b, prev)})`: no
  /// vector is built for the call.
  Work batch_p2p(std::initializer_list<P2POp> ops, bool async_op = false);

 protected:
  Communicator(std::string backend, std::string name, int rank, int size, Device device, const CommOptions& opts);

  /// Starts a validated operation whose tensors are contiguous and in the backend's memory
  /// (see host_memory_only). Returns the state that completes when the op does, or nullptr
  /// when the op already completed inside the call (a synchronous op the backend ran inline).
  virtual std::shared_ptr<detail::WorkState> start(detail::OpCall&& call) = 0;
  /// Creates the sub-communicator for `color` (>= 0) or returns nullptr; called with seq assigned.
  virtual std::shared_ptr<Communicator> do_split(int color, int key, uint64_t seq) = 0;
  /// True when the backend reads host memory only: device tensors are staged through the host.
  /// False for a device backend: host tensors are staged through the communicator's device.
  virtual bool host_memory_only() const { return true; }
  /// True when the backend compares every collective's signature across ranks, debug mode or
  /// not (then OpCall::sig is always filled; otherwise only in debug mode).
  virtual bool checks_every_call() const { return false; }

  /// A synchronous op (a collective, or a batch of up to 8 sends and receives) that nothing
  /// records (no trace, observer or signature check), on tensors the backend can use as they are:
  /// the backend may run it at once from `q` (pointers, counts and what the watchdog shows), with
  /// no call record, and return true; or return false, having done nothing, and the op goes
  /// through start(). q.seq is the op's sequence number (point-to-point ops: their own counter).
  virtual bool run_quick(const detail::QuickOp& q) { return false; }

  /// The name a sub-communicator of this one gets.
  std::string child_name(uint64_t seq, int color) const;

 private:
  Work launch(detail::OpCall&& call, std::vector<std::function<void()>>&& copy_back, bool async_op);
  detail::OpCall begin(int kind, const Tensor& subject, bool collective);
  bool usable_as_is(const Tensor& t) const;
  Device staging_device(const Tensor& x, const char* op) const;
  bool signs() const { return debug_ || checks_every_call(); }
  Tensor prepare_input(const Tensor& t, const char* op) const;
  Tensor prepare_output(const Tensor& t, bool read_too, std::vector<std::function<void()>>& copy_back) const;
  // slot = `t` borrowed (owner = &t) where the backend can use it as it is; false otherwise.
  bool borrow_into(Tensor& slot, const Tensor*& owner, const Tensor& t) const;
  // c.in / c.out: borrowed, else prepare_input / prepare_output's copy. bind_in copies an input
  // that overlaps `out` first; bind_in_place makes in and out the same tensor.
  void bind_in(detail::OpCall& c, const Tensor& t, const Tensor& out, const char* op) const;
  void bind_out(detail::OpCall& c, const Tensor& t, bool read_too, std::vector<std::function<void()>>& copy_back) const;
  void bind_in_place(detail::OpCall& c, const Tensor& t, bool read_too,
                     std::vector<std::function<void()>>& copy_back) const;
  void check_root(int root, const char* op, const char* what) const;
  // Runs a validated synchronous collective through run_quick where it applies (in and out may
  // be the same tensor); true when it ran. Fills q's seq, pointers and shape.
  bool try_quick(detail::QuickOp& q, const Tensor& in, const Tensor& out, const Tensor& subject);
  Work batch_p2p(const P2POp* ops, size_t n, bool async_op);

  std::string backend_;
  const std::string* name_;  // interned (detail::CommName::intern): op descriptions point at it
  std::string axis_;  // mesh axis, for traces
  int rank_ = 0, size_ = 1;
  Device device_;
  std::chrono::milliseconds timeout_;
  bool debug_ = false;
  uint64_t seq_ = 0;      // collectives issued
  uint64_t p2p_seq_ = 0;  // point-to-point ops issued (they do not match across ranks)
};

/// Creates an n-rank in-process group: element r is rank r's communicator. Each must be driven
/// by its own thread. Collectives that time out throw an Error naming the op, its sequence
/// number and the ranks that had not arrived (the group is unusable afterwards).
std::vector<std::shared_ptr<Communicator>> make_threads_group(int n, const CommOptions& opts = {});

/// Runs fn(comm) for ranks 0..n-1 on n threads of a fresh threads group and joins them. When a
/// rank throws, the others' pending and later collectives fail at once, and the first failing
/// rank's error (by time) is rethrown here.
void run_threads_group(int n, const std::function<void(Communicator&)>& fn, const CommOptions& opts = {});

/// True when this build has NCCL and a CUDA device is usable.
bool nccl_available();
/// An NCCL communicator over the ranks of `bootstrap` (which broadcasts the unique id), on CUDA
/// device `device`; collective over `bootstrap`. Throws in builds without NCCL.
std::shared_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, Device device,
                                                     const CommOptions& opts = {});

}  // namespace quilt
