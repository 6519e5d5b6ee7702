// Internal to collectives/: the pieces the backends share (operation descriptions, Work state,
// the in-order executor, the watchdog registry, host reduction kernels). No MPI or CUDA types
// here, so every backend and the stubs can include it. Not part of the public API.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/launch.h"

namespace quilt::detail {

using Clock = std::chrono::steady_clock;

/// A communicator's name as op descriptions hold it: interned once per distinct name (names are
/// few and live as long as the process), so describing an op copies a pointer, not a string,
/// and a description outlives the communicator it came from.
class CommName {
 public:
  CommName() = default;
  CommName(const std::string& name);  // NOLINT: implicit, like the string it stands for
  CommName(const char* name) : CommName(std::string(name)) {}  // NOLINT
  /// From a string intern() returned: no lookup.
  static CommName interned(const std::string* s) {
    CommName n;
    n.s_ = s;
    return n;
  }
  /// The one stored copy of `name`, created on first use and never freed.
  static const std::string* intern(const std::string& name);
  const std::string& str() const { return s_ ? *s_ : empty(); }
  operator const std::string&() const { return str(); }  // NOLINT
  friend std::ostream& operator<<(std::ostream& os, const CommName& n) { return os << n.str(); }

 private:
  static const std::string& empty();
  const std::string* s_ = nullptr;
};

enum class OpKind : uint8_t {
  all_reduce, broadcast, reduce, all_gather, all_gather_v, reduce_scatter, reduce_scatter_v,
  all_to_all, barrier, split,  // collectives: numbered in the same order on every rank
  send, recv, batch_p2p,       // point to point: numbered per rank only
};

/// "all_reduce", "all_to_all_single", ...
const char* op_kind_name(OpKind k);
inline bool is_collective(OpKind k) { return k <= OpKind::split; }

/// A shape held inline up to 8 dims, so describing an op allocates nothing; longer shapes
/// spill to the heap.
class OpShape {
 public:
  OpShape() = default;
  OpShape(const Shape& s) { *this = s; }  // NOLINT: implicit, like the Shape it stands for
  OpShape& operator=(const Shape& s) {
    n_ = s.size();
    if (n_ <= kInline) {
      for (size_t i = 0; i < n_; ++i) dims_[i] = s[i];
      spill_.clear();
    } else {
      spill_ = s;
    }
    return *this;
  }
  size_t size() const { return n_; }
  int64_t operator[](size_t i) const { return n_ <= kInline ? dims_[i] : spill_[i]; }
  Shape vec() const { return n_ <= kInline ? Shape(dims_, dims_ + n_) : spill_; }
  int64_t numel() const {
    int64_t p = 1;
    for (size_t i = 0; i < n_; ++i) p *= (*this)[i];
    return p;
  }

 private:
  static constexpr size_t kInline = 8;
  int64_t dims_[kInline] = {};
  size_t n_ = 0;
  Shape spill_;
};

/// What an operation is, for errors and the watchdog.
struct OpDesc {
  OpKind kind = OpKind::barrier;
  uint64_t seq = 0;     // collective sequence number (1-based), or the p2p counter
  CommName comm;        // communicator name
  int rank = 0;         // the issuing rank
  bool has_tensor = false;
  DType dtype = DType::f32;
  OpShape shape;        // the op's main tensor: t, in (gathers, all_to_all) or out (scatters)
  std::optional<ReduceOp> rop;
  int root = -1;        // root of broadcast/reduce, peer of send/recv, number of ops of batch_p2p
  int tag = 0;
  std::chrono::milliseconds delay{0};  // held back this long before running (an observer's fault injection)
  /// "all_reduce #5 on world (shape (4, 3), f32, sum)".
  std::string str() const;
  /// "all_reduce #5".
  std::string short_str() const;
};

/// Fixed-size summary of a collective that must agree across ranks (exchanged by the debug
/// check; compared on every call by the threads backend). Variable-size ops put only the dims
/// after dim 0 in `dims` and a hash of their row/split lists in `extra_hash`.
struct Signature {
  uint64_t seq = 0;
  uint64_t shape_hash = 0;
  uint64_t extra_hash = 0;
  int32_t kind = 0, dtype = 0, rop = -1, root = -1, ndim = 0, trailing_only = 0;
  int64_t dims[8] = {};
  bool operator==(const Signature&) const = default;
  /// "all_reduce #5 with shape (4, 3), f32, sum".
  std::string str() const;
};

/// Throws "[op] ranks disagree on collective #seq of <comm>: ..." naming the first rank that
/// differs from the signature most ranks hold (ties: the lowest such rank's).
void check_signatures(const std::vector<Signature>& all, const OpDesc& d);

/// One transfer of a batch (also used for single send/recv).
struct P2PItem {
  bool is_send = true;
  Tensor tensor;                   // contiguous, backend memory
  const Tensor* owner = nullptr;   // the caller's tensor `tensor` is borrowed from, if it is
  int peer = 0;
  int tag = 0;
};

/// A handle on t's data that holds no reference: copying or dropping it costs no atomic
/// operation (a shared_ptr's reference count is a locked instruction, tens of nanoseconds on some
/// machines, and a small collective copied its tensors' handles four to six times). Valid while t
/// lives; OpCall::own turns it into a real reference.
inline Tensor borrow(const Tensor& t) {
  return Tensor(std::shared_ptr<TensorImpl>(std::shared_ptr<TensorImpl>(), t.impl_ptr().get()));
}

/// A validated operation as the backends receive it: contiguous tensors in the backend's memory.
/// `in` and `out` may be borrowed from the caller's tensors (see borrow): a backend that keeps the
/// call past start() (a queue, an asynchronous op, a stream) calls own() first.
struct OpCall {
  OpDesc desc;
  Tensor in, out;                    // in-place ops: in and out are the same tensor
  const Tensor* in_owner = nullptr;  // the caller's tensor `in` is borrowed from, if it is
  const Tensor* out_owner = nullptr;
  std::vector<int64_t> in_counts;    // elements sent to each rank (all_to_all), per-rank sizes of v forms
                                     // (empty for all_gather and reduce_scatter: equal sizes)
  std::vector<int64_t> out_counts;   // elements received from each rank (all_to_all)
  bool even_splits = false;          // all_to_all called without splits (every rank does): one block size,
  int64_t even_in = 0, even_out = 0;  // the elements sent to and received from each rank; the count
                                      // lists stay empty (no allocation on the small-call path)
  std::vector<P2PItem> p2p;          // send, recv, batch_p2p
  int color = -1, key = 0;           // split
  bool async = false;
  Signature sig;                     // filled when signatures are checked (debug mode, threads backend)

  /// An even all_to_all's per-rank counts as lists, for backends that walk them per rank.
  void expand_even_splits(int ranks) {
    if (!even_splits) return;
    in_counts.assign(size_t(ranks), even_in);
    out_counts.assign(size_t(ranks), even_out);
  }
  /// Makes borrowed `in`, `out` and p2p tensors real references, so the call may outlive the caller's frame.
  void own() {
    if (in_owner) in = *in_owner;
    if (out_owner) out = *out_owner;
    in_owner = out_owner = nullptr;
    for (P2PItem& it : p2p) {
      if (it.owner) it.tensor = *it.owner;
      it.owner = nullptr;
    }
  }
};

/// The call record of split(color, key) #seq on communicator `comm` as seen by `rank`.
OpCall split_call(const std::string& comm, int rank, int color, int key, uint64_t seq);

/// Shared state behind a Work. Host backends complete it with mark_done / mark_failed from the
/// thread that ran the op; device backends override poll/block for event-based completion.
class WorkState {
 public:
  WorkState(OpDesc desc, std::chrono::milliseconds timeout);
  virtual ~WorkState();
  WorkState(const WorkState&) = delete;
  WorkState& operator=(const WorkState&) = delete;

  const OpDesc desc;
  const std::chrono::milliseconds timeout;
  const Clock::time_point issued;
  const Clock::time_point deadline;
  std::vector<Tensor> keep;                       // buffers that must outlive the op
  std::vector<std::function<void()>> copy_back;   // run once after completion, by finish()

  /// Marks success (no effect once finished).
  void mark_done();
  /// Marks failure with the error message later thrown by wait() (no effect once finished).
  void mark_failed(std::string message);
  bool done_flag() const { return status_.load(std::memory_order_acquire) != 0; }
  bool failed() const { return status_.load(std::memory_order_acquire) == 2; }
  std::string error() const;

  /// True once finished; may advance the op (MPI requests, CUDA events). Never blocks.
  virtual bool poll();
  /// Blocks the host until finished or `until`; true when finished.
  virtual bool block_until(std::optional<Clock::time_point> until);
  /// What Work::wait() does before finish(): blocks the host (NCCL: makes the current stream wait).
  virtual void wait_for_use() { block_until(std::nullopt); }
  /// Throws the op's error, else runs the copy-backs (once).
  void finish();

 protected:
  std::atomic<int> status_{0};  // 0 pending, 1 done, 2 failed
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string error_;
  bool copied_back_ = false;
};

/// Runs a communicator's collectives one at a time in issue order: inline on the caller when
/// nothing is queued and the call is synchronous (no hand-off latency), otherwise on a worker
/// thread, so async work progresses without the caller polling and every backend call happens
/// in the same order on every rank.
class OpExecutor {
 public:
  using Body = std::function<void()>;
  OpExecutor() = default;
  ~OpExecutor();
  OpExecutor(const OpExecutor&) = delete;
  OpExecutor& operator=(const OpExecutor&) = delete;

  /// Runs `body` for `w` after all earlier submissions; a throw marks `w` failed.
  void submit(const std::shared_ptr<WorkState>& w, Body body, bool async);
  /// True when nothing is queued or running. Exact when called from the one thread that
  /// submits (the communicator's user): then nothing can be added meanwhile, and the caller may
  /// run a synchronous op itself without going through submit.
  bool idle() const { return outstanding_.load(std::memory_order_acquire) == 0; }
  /// Blocks until every submitted body has run.
  void drain();
  /// Drains, then stops the worker thread.
  void stop();

 private:
  static void run(const std::shared_ptr<WorkState>& w, Body& body);
  void loop();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<std::shared_ptr<WorkState>, Body>> queue_;
  std::atomic<int64_t> outstanding_{0};  // queued or running on the worker
  bool busy_ = false, stopping_ = false;
  std::thread worker_;
};

/// Progress of one communicator on this rank, read by the watchdog and by peers' watchdogs
/// (through the backend's side channel). Values are collective sequence numbers.
struct CommTrace {
  std::string name;
  uint64_t uid = 0;              // stable_hash(name): equal on every member rank
  std::vector<int> world_ranks;  // world rank of each member
  std::atomic<uint64_t> issued{0}, started{0}, completed{0};
  std::atomic<int> started_kind{-1};  // OpKind of `started`
};

/// One send or receive of a synchronous batch as a host backend posts it: contiguous data in its
/// memory, resolved once (the quick path's and the inline batch's form).
struct P2PBuffer {  // no member initializers: a call's array of them is not zero-filled first
  void* data;
  int64_t count;  // elements
  DType dtype;
  int peer, tag;
  bool is_send;
};
/// The buffers of `t` (contiguous, in the backend's memory) sent to or received from `peer`.
inline P2PBuffer p2p_buffer(const Tensor& t, bool is_send, int peer, int tag) {
  return {t.data_ptr(), t.numel(), t.dtype(), peer, tag, is_send};
}
/// The most transfers a synchronous batch posts on its caller's thread (more go as a Work).
inline constexpr size_t kInlineP2P = 8;

/// A synchronous collective that nothing records (no trace, observer or signature check) on
/// contiguous tensors in the backend's memory, described without a call record for
/// Communicator::run_quick. Counts are what the backend's call takes and fit an int: the tensor's
/// elements (all_reduce, broadcast), in's (all_gather), out's (reduce_scatter), or the block sent
/// to and received from each rank (an all_to_all without splits: `count`, `recv_count`). A
/// synchronous send, recv or batch_p2p carries its transfers instead (`p2p`; root: the peer of a
/// single op, else the number of ops; shape: a single op's tensor's).
struct QuickOp {
  // (A constructor, not an aggregate: GCC clears an aggregate's omitted members with `rep stos`,
  // slow to start on AMD cores, before storing the given ones.)
  QuickOp(OpKind k, DType dt, int64_t n = 0, std::optional<ReduceOp> op = std::nullopt, int rt = -1)
      : kind(k), dtype(dt), rop(op), root(rt), count(n) {}
  OpKind kind;
  uint64_t seq = 0;
  DType dtype;
  std::optional<ReduceOp> rop;
  int root;
  const Shape* shape = nullptr;  // the op's main tensor's, as OpDesc::shape
  const void* in = nullptr;      // == out for in-place ops
  void* out = nullptr;
  int64_t count, recv_count = 0;
  int tag = 0;                      // send, recv
  const P2PBuffer* p2p = nullptr;   // send, recv, batch_p2p: the transfers, p2p_count of them
  size_t p2p_count = 0;
};

/// The collective a communicator runs inline on its caller's thread right now: synchronous
/// ops that complete inside the call get no WorkState and no watchdog entry; instead they
/// publish themselves here (plain stores, no lock, no allocation) and the watchdog scans every
/// registered slot each tick. An op that stays in its slot past the timeout fires the watchdog
/// exactly as a watched work would, naming the op, its sequence number, shape, dtype and the
/// missing ranks. Writer: the communicator's user thread; reader: the watchdog thread (a
/// seqlock on `seq`: fields are written before seq is published and re-checked after reading).
struct InlineSlot {
  CommName comm;     // communicator name (constant)
  int rank = 0;      // the issuing rank (constant)
  std::shared_ptr<CommTrace> trace;
  std::atomic<uint64_t> seq{0};  // 0: nothing running inline, else the op's sequence number
  std::atomic<int64_t> timeout_ms{0};
  std::atomic<int32_t> kind{0}, dtype{0}, rop{-1}, root{-1}, ndim{-1}, tag{0};
  std::atomic<int64_t> dims[8] = {};

  /// Publishes `d` as running (d.shape beyond 8 dims is summarised by its first 8).
  void enter(const OpDesc& d, std::chrono::milliseconds timeout) {
    publish(d.kind, d.seq, d.has_tensor ? &d.shape : nullptr, d.dtype, d.rop ? int32_t(*d.rop) : -1, d.root, d.tag,
            timeout);
  }
  /// The same for a quick op (no call record).
  void enter(const QuickOp& q, std::chrono::milliseconds timeout) {
    publish(q.kind, q.seq, q.shape, q.dtype, q.rop ? int32_t(*q.rop) : -1, q.root, q.tag, timeout);
  }
  void leave() { seq.store(0, std::memory_order_release); }
  /// Leaves the slot when it goes: `slot.enter(d, t); InlineSlot::Occupied in{slot};`.
  struct Occupied {
    InlineSlot& slot;
    ~Occupied() { slot.leave(); }
  };
  /// The running op's description and timeout, or nullopt when none runs (or it changed while
  /// being read). Watchdog thread only.
  std::optional<std::pair<OpDesc, std::chrono::milliseconds>> snapshot() const;

  // Watchdog thread only: the sequence number it last saw running here, and since when.
  uint64_t seen_seq = 0;
  Clock::time_point seen_at{};

 private:
  // `shape` null: the op has no tensor (dtype and dims are then not shown).
  template <class S>
  void publish(OpKind k, uint64_t s, const S* shape, DType dt, int32_t op, int32_t rt, int32_t tg,
               std::chrono::milliseconds timeout) {
    timeout_ms.store(timeout.count(), std::memory_order_relaxed);
    kind.store(int32_t(k), std::memory_order_relaxed);
    dtype.store(shape ? int32_t(dt) : -1, std::memory_order_relaxed);
    rop.store(op, std::memory_order_relaxed);
    root.store(rt, std::memory_order_relaxed);
    tag.store(tg, std::memory_order_relaxed);
    const size_t nd = shape ? shape->size() : 0;
    ndim.store(shape ? int32_t(nd) : -1, std::memory_order_relaxed);
    for (size_t i = 0; i < nd && i < 8; ++i) dims[i].store((*shape)[i], std::memory_order_relaxed);
    seq.store(s, std::memory_order_release);
  }
};

namespace watchdog {
/// What the backend plugs in; every hook runs on the watchdog thread.
struct Hooks {
  std::function<void()> tick;  // called every tick (serves peers' queries)
  /// Asks the members of the work's communicator how far they got; returns the text that
  /// names the ranks that had not arrived.
  std::function<std::string(const WorkState&, const CommTrace&)> who_is_missing;
  std::function<void()> abort_job;  // never returns
};
/// Starts the watchdog thread (no-op when running); later calls replace the hooks.
void start(Hooks hooks);
/// Stops and joins the thread (pending watched works are dropped).
void stop();
/// Watches `w`: when it is not complete by its deadline, the job is aborted with a message.
void watch(const std::shared_ptr<WorkState>& w, const std::shared_ptr<CommTrace>& trace);
/// Scans `slot` every tick while it lives (weakly held; a communicator registers its slot once).
void watch_inline(const std::shared_ptr<InlineSlot>& slot);
/// Runs before abort_job when the watchdog fires (NCCL: ncclCommAbort); returns an id.
uint64_t add_abort_hook(std::function<void()> f);
void remove_abort_hook(uint64_t id);
/// Makes the trace findable by uid for the side channel (weakly held).
void register_trace(const std::shared_ptr<CommTrace>& t);
std::shared_ptr<CommTrace> find_trace(uint64_t uid);
/// The works currently watched (tests and finalize use it).
size_t watched_count();
/// Formats the reply of a member: "2 (last started all_reduce #4)".
std::string describe_progress(int rank, uint64_t started, int started_kind, uint64_t completed);
}  // namespace watchdog

// ---- host kernels (collectives/host_reduce.cpp) ----
/// dst[i] = op over s of srcs[s][i] (srcs may include dst); 16-bit floats accumulate in float.
/// avg is treated as sum here (divide afterwards with divide_by).
void reduce_many(DType dt, ReduceOp op, void* dst, const void* const* srcs, int nsrc, int64_t n);
/// inout[i] = op(inout[i], in[i]).
void combine_into(DType dt, ReduceOp op, void* inout, const void* in, int64_t n);
/// data[i] /= divisor (integers truncate toward zero); bool is an error.
void divide_by(DType dt, void* data, int64_t n, int divisor);

// ---- misc ----
/// "3 s", "250 ms", "1.5 s".
std::string format_duration(std::chrono::milliseconds d);
/// Rank printed in "[rank N]" prefixes (set by init_from_launcher; before that from the environment).
void set_log_rank(int rank);
int log_rank();

/// The single-rank communicator used without a launcher (backend "local", threads underneath).
std::shared_ptr<Communicator> make_local_communicator(const CommOptions& opts);

// MPI bootstrap (collectives/mpi_backend.cpp).
struct MpiWorld {
  std::shared_ptr<Communicator> world;
  LaunchInfo info;
};
/// MPI_Init_thread (unless already initialised), world communicator, local rank, watchdog.
MpiWorld mpi_init_world(const CommOptions& opts, const std::string& launcher);
/// Drains outstanding work, barrier, stops the watchdog, frees communicators, MPI_Finalize.
void mpi_finalize_world();
/// Tells every other rank that this one is ending on `message` (printed by them unless
/// `printed`); their watchdogs end them at once. Waits up to a second for the notices to leave.
/// False when no one would hear it (MPI not running, or no MPI_THREAD_MULTIPLE).
bool mpi_announce_failure(const std::string& message, bool printed);
/// MPI_Abort on the world.
[[noreturn]] void mpi_abort_world(int code);

}  // namespace quilt::detail
