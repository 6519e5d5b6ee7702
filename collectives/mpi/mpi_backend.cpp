// The MPI backend and the MPI bootstrap of every launch.
//
// Execution: each communicator runs its collectives in issue order on an OpExecutor, as
// blocking MPI calls (inline on the caller when synchronous and idle, else on the executor's
// worker thread). Blocking calls get Open MPI's tuned algorithms (its non-blocking ones go
// through a slower generic schedule), async work progresses without the caller polling, and a
// rank mixing async and sync calls still matches its peers. Point-to-point ops use
// MPI_Isend/MPI_Irecv directly, so a pipeline's sends and receives never queue behind each other.
// 16-bit floats reduce through user-defined MPI_Ops that add in float, not as raw bytes.
//
// Side channel for the watchdog: at start-up every rank duplicates MPI_COMM_WORLD into a
// "watch" communicator used only by the watchdog threads. Each watchdog keeps a receive posted
// there for queries; a rank whose op times out sends every member of the op's communicator a
// query naming it, and each member replies (from its own watchdog thread, even while its main
// thread is blocked inside MPI) with how far it got on that communicator: the last collective
// issued, started and completed. Members that do not answer within a grace period are reported
// as such (stopped or dead). Point-to-point on a dedicated communicator keeps working across
// hosts (unlike files in /dev/shm) and needs no progress on the target for one-sided windows to
// answer; it requires MPI_THREAD_MULTIPLE, without which the watchdog still aborts but cannot
// say who is missing.
//
// The same channel carries failure notices: a rank that ends on an error tells every other rank
// (announce_failure), whose watchdogs end their processes at once, even while their main threads
// wait inside a collective for the rank that failed.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <thread>

#include "collectives/internal.h"
#include "engine/random.h"

#define QUILT_CHECK_MPI(call)                                                           \
  do {                                                                                  \
    const int quilt_mpi_rc_ = (call);                                                   \
    if (quilt_mpi_rc_ != MPI_SUCCESS) ::quilt::detail::throw_mpi_error(quilt_mpi_rc_, #call, __FILE__, __LINE__); \
  } while (0)

namespace quilt::detail {
namespace {

[[noreturn]] void throw_mpi_error(int rc, const char* expr, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  std::string f(file);
  const size_t at = f.rfind("/collectives/");
  fail("[mpi] ", expr, " failed: ", text, " at ", at == std::string::npos ? f : f.substr(at + 1), ":", line);
}

constexpr int kQueryTag = 7001;
constexpr int kReplyTag = 7002;
constexpr int kFailureTag = 7003;
// A failure notice: one byte (kLoud: the receivers print it; kQuiet: it is printed already),
// then the message.
constexpr int kNoticeBytes = 4096;
constexpr char kLoud = 'L', kQuiet = 'Q';
constexpr int kAckTag = 7004;
// How long a failing rank waits for acknowledgements (a stopped or dead peer never sends one),
// and a notified rank for the launcher to end it before it exits on its own.
constexpr auto kAckWait = std::chrono::milliseconds(1500);
constexpr auto kLauncherWait = std::chrono::milliseconds(300);
constexpr auto kQueryGrace = std::chrono::milliseconds(2000);

struct Query {
  uint64_t uid = 0;
};
struct Reply {
  uint64_t uid = 0;
  uint64_t found = 0;
  uint64_t issued = 0, started = 0, completed = 0;
  int64_t started_kind = -1;
};

class MpiCommunicator;

// Process-wide MPI state (created by mpi_init_world, torn down by mpi_finalize_world).
struct Globals {
  bool initialized = false;
  bool finalized = false;
  bool we_initialized = false;
  bool multiple = false;  // MPI_THREAD_MULTIPLE provided
  int world_rank = 0;
  int world_size = 1;
  MPI_Comm watch = MPI_COMM_NULL;
  MPI_Datatype bf16 = MPI_DATATYPE_NULL, f16 = MPI_DATATYPE_NULL;
  MPI_Op op_sum = MPI_OP_NULL, op_max = MPI_OP_NULL, op_min = MPI_OP_NULL;
  std::mutex mu;
  std::vector<std::weak_ptr<MpiCommunicator>> comms;
  // Responder state, touched only by the watchdog thread.
  MPI_Request query_req = MPI_REQUEST_NULL;
  Query query_buf;
  std::vector<std::pair<MPI_Request, std::unique_ptr<Reply>>> replies;
  MPI_Request notice_req = MPI_REQUEST_NULL;
  char notice_buf[kNoticeBytes] = {};
};

Globals& g() {
  static Globals* s = new Globals();
  return *s;
}

// ---- dtypes and reduction ops ----
void user_reduce(ReduceOp op, void* in, void* inout, int* len, MPI_Datatype* dt) {
  const DType d = *dt == g().bf16 ? DType::bf16 : DType::f16;
  combine_into(d, op, inout, in, *len);
}
void user_sum(void* in, void* inout, int* len, MPI_Datatype* dt) { user_reduce(ReduceOp::sum, in, inout, len, dt); }
void user_max(void* in, void* inout, int* len, MPI_Datatype* dt) { user_reduce(ReduceOp::max, in, inout, len, dt); }
void user_min(void* in, void* inout, int* len, MPI_Datatype* dt) { user_reduce(ReduceOp::min, in, inout, len, dt); }

MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::b8: return MPI_UINT8_T;
    case DType::bf16: return g().bf16;
    case DType::f16: return g().f16;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(DType dt, ReduceOp op) {
  const bool half = dt == DType::bf16 || dt == DType::f16;
  if (dt == DType::b8) return op == ReduceOp::min ? MPI_MIN : MPI_MAX;  // or / and on 0-1 bytes
  switch (op) {
    case ReduceOp::max: return half ? g().op_max : MPI_MAX;
    case ReduceOp::min: return half ? g().op_min : MPI_MIN;
    default: return half ? g().op_sum : MPI_SUM;  // avg divides afterwards
  }
}

int to_count(int64_t n, const OpDesc& d) {
  QUILT_CHECK(n <= INT_MAX, "[", op_kind_name(d.kind), "] ", d.short_str(), ": ", n,
              " elements exceed the MPI backend's limit of 2^31-1 per call; split the tensor");
  return int(n);
}

std::vector<int> to_counts(const std::vector<int64_t>& v, const OpDesc& d) {
  std::vector<int> out;
  for (int64_t x : v) out.push_back(to_count(x, d));
  return out;
}

std::vector<int> displacements(const std::vector<int>& counts, const OpDesc& d) {
  std::vector<int> out(counts.size());
  int64_t at = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    out[i] = to_count(at, d);
    at += counts[i];
  }
  return out;
}

// n ints, inline up to 64 (no allocation per call), else on the heap.
class CountBuf {
 public:
  explicit CountBuf(size_t n) : p_(n <= kInline ? inline_ : (heap_.resize(n), heap_.data())) {}
  int& operator[](size_t i) { return p_[i]; }
  int* data() { return p_; }

 private:
  static constexpr size_t kInline = 64;
  int inline_[kInline];
  std::vector<int> heap_;
  int* p_;
};

std::vector<int> world_ranks_of(MPI_Comm comm) {
  MPI_Group grp, world_grp;
  int n = 0;
  MPI_Comm_size(comm, &n);
  MPI_Comm_group(comm, &grp);
  MPI_Comm_group(MPI_COMM_WORLD, &world_grp);
  std::vector<int> mine(static_cast<size_t>(n)), out(static_cast<size_t>(n));
  std::iota(mine.begin(), mine.end(), 0);
  MPI_Group_translate_ranks(grp, n, mine.data(), world_grp, out.data());
  MPI_Group_free(&grp);
  MPI_Group_free(&world_grp);
  return out;
}

// The failure of a finished batch of point-to-point requests ("" when there is none): an MPI
// error, or a receive that got another element count than it expects (expected[i] < 0: a send).
// desc_of() gives the op's OpDesc (by value or reference); called only to word a failure.
template <class DescOf>
std::string p2p_failure(DescOf&& desc_of, int rc, const MPI_Status* st, size_t n, const int* expected,
                        const MPI_Datatype* types, const int* peers) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    int err = rc;
    for (size_t i = 0; i < n; ++i)
      if (st[i].MPI_ERROR != MPI_SUCCESS && st[i].MPI_ERROR != MPI_ERR_PENDING) err = st[i].MPI_ERROR;
    MPI_Error_string(err, text, &len);
    const OpDesc& desc = desc_of();
    return concat("[", op_kind_name(desc.kind), "] ", desc.str(), " failed: ", text,
                  err == MPI_ERR_TRUNCATE ? " (the matching send has more elements than the receive)" : "");
  }
  for (size_t i = 0; i < n; ++i) {
    if (expected[i] < 0) continue;
    int got = 0;
    MPI_Get_count(&st[i], types[i], &got);
    if (got != expected[i])
      return concat("[recv] ", desc_of().str(), ": rank ", peers[i], " sent ", got, " elements but the receive expects ",
                    expected[i]);
  }
  return {};
}

// ---- point-to-point work: MPI requests tested by whoever gets there first ----
class MpiP2PWork final : public WorkState {
 public:
  MpiP2PWork(OpDesc d, std::chrono::milliseconds t) : WorkState(std::move(d), t) {}
  std::vector<MPI_Request> reqs;
  std::vector<int> expected;  // per request: elements a receive expects, -1 for sends
  std::vector<MPI_Datatype> types;
  std::vector<int> peers;
  bool use_mpi_from_any_thread = true;

  bool poll() override {
    if (done_flag()) return true;
    if (!use_mpi_from_any_thread) return false;
    std::unique_lock lk(req_mu_, std::try_to_lock);
    if (!lk.owns_lock() || done_flag()) return done_flag();
    std::vector<MPI_Status> st(reqs.size());
    int flag = 0;
    const int rc = MPI_Testall(int(reqs.size()), reqs.data(), &flag, st.data());
    if (rc != MPI_SUCCESS || flag) complete(rc, st);
    return done_flag();
  }

  bool block_until(std::optional<Clock::time_point> until) override {
    if (done_flag()) return true;
    if (!until) {
      std::lock_guard lk(req_mu_);
      if (done_flag()) return true;
      std::vector<MPI_Status> st(reqs.size());
      const int rc = MPI_Waitall(int(reqs.size()), reqs.data(), st.data());
      complete(rc, st);
      return true;
    }
    while (Clock::now() < *until) {
      if (poll()) return true;
      std::this_thread::yield();
    }
    return poll();
  }

 private:
  void complete(int rc, std::vector<MPI_Status>& st) {
    std::string failure = p2p_failure([&]() -> const OpDesc& { return desc; }, rc, st.data(), reqs.size(),
                                      expected.data(), types.data(), peers.data());
    if (failure.empty()) mark_done();
    else mark_failed(std::move(failure));
  }
  std::mutex req_mu_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, int rank, int size, const CommOptions& opts)
      : Communicator("mpi", name, rank, size, Device::cpu(), opts), comm_(comm), opts_(opts) {
    trace_ = std::make_shared<CommTrace>();
    trace_->name = name;
    trace_->uid = stable_hash(name);
    trace_->world_ranks = world_ranks_of(comm);
    watchdog::register_trace(trace_);
    for (auto* slot : {&slot_, &p2p_slot_}) {
      *slot = std::make_shared<InlineSlot>();
      (*slot)->comm = name;
      (*slot)->rank = rank;
      (*slot)->trace = trace_;
      watchdog::watch_inline(*slot);
    }
  }

  ~MpiCommunicator() override { shutdown(); }

  // Finishes queued work and releases the MPI communicator (before MPI_Finalize).
  void shutdown() {
    exec_.stop();
    if (comm_ != MPI_COMM_NULL && !g().finalized) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }
  void drain() { exec_.drain(); }
  MPI_Comm handle() const { return comm_; }

  static std::shared_ptr<MpiCommunicator> create(MPI_Comm comm, const std::string& name, const CommOptions& opts) {
    QUILT_CHECK_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    auto c = std::make_shared<MpiCommunicator>(comm, name, rank, size, opts);
    std::lock_guard lk(g().mu);
    std::erase_if(g().comms, [](const auto& w) { return w.expired(); });
    g().comms.push_back(c);
    return c;
  }

 protected:
  std::shared_ptr<WorkState> start(OpCall&& c) override {
    QUILT_CHECK(comm_ != MPI_COMM_NULL, "[", op_kind_name(c.desc.kind), "] communicator ", name(),
                " was used after finalize()");
    if (!is_collective(c.desc.kind)) return start_p2p(c);
    trace_->issued.store(c.desc.seq, std::memory_order_release);
    const bool dbg = debug_checks();
    // Without MPI_THREAD_MULTIPLE only the caller's thread may call MPI: run everything inline.
    const bool async = c.async && g().multiple;
    if (!async && c.desc.shape.size() <= 8 && exec_.idle()) {
      run_inline(c, dbg);
      return nullptr;  // complete
    }
    c.own();  // queued on the executor: it may outlive the caller's frame (a timed-out wait)
    auto w = std::make_shared<WorkState>(c.desc, timeout());
    watchdog::watch(w, trace_);
    exec_.submit(w, [this, c = std::move(c), dbg, async]() mutable { run(c, dbg, /*polite=*/async); }, async);
    return w;
  }

  // The quick form (see Communicator::run_quick) of the synchronous path below: the same blocking
  // calls, trace marks and watchdog slot, with nothing to unpack from a call record. Declines
  // where run_inline would not run (asynchronous work queued) or the communicator is gone.
  bool run_quick(const QuickOp& q) override {
    if (comm_ == MPI_COMM_NULL) return false;
    if (q.p2p) return run_quick_p2p(q);
    if (!exec_.idle()) return false;
    trace_->issued.store(q.seq, std::memory_order_release);
    slot_->enter(q, timeout());
    InlineSlot::Occupied occupied{*slot_};
    Progress p(*trace_, q.kind, q.seq);
    const int n = int(q.count);
    call_blocking(q.kind, q.in, q.out, n, int(q.recv_count), q.dtype, q.rop, q.root);
    if (q.rop == ReduceOp::avg) divide_by(q.dtype, q.out, n, size());  // all_reduce, reduce_scatter
    return true;
  }

  // The blocking MPI call of an op that takes one count per rank (all_reduce, broadcast,
  // all_gather, reduce_scatter, all_to_all without splits): the one form both the general
  // synchronous path and the quick path issue. Throws naming the call when MPI fails.
  void call_blocking(OpKind kind, const void* in, void* out, int n, int recv_n, DType dt, std::optional<ReduceOp> rop,
                     int root) {
    const MPI_Datatype type = mpi_type(dt);
    int rc = MPI_SUCCESS;
    const char* call = "";
    switch (kind) {
      case OpKind::all_reduce:
        call = "MPI_Allreduce";
        rc = MPI_Allreduce(MPI_IN_PLACE, out, n, type, mpi_op(dt, *rop), comm_);
        break;
      case OpKind::broadcast:
        call = "MPI_Bcast";
        rc = MPI_Bcast(out, n, type, root, comm_);
        break;
      case OpKind::all_gather:
        call = "MPI_Allgather";
        rc = MPI_Allgather(in, n, type, out, n, type, comm_);
        break;
      case OpKind::reduce_scatter:
        call = "MPI_Reduce_scatter_block";
        rc = MPI_Reduce_scatter_block(in, out, n, type, mpi_op(dt, *rop), comm_);
        break;
      case OpKind::all_to_all:
        call = "MPI_Alltoall";
        rc = MPI_Alltoall(in, n, type, out, recv_n, type, comm_);
        break;
      default:
        fail("[mpi] ", op_kind_name(kind), " has no one-count blocking form");
    }
    if (rc != MPI_SUCCESS) throw_mpi_error(rc, call, __FILE__, __LINE__);
  }

  std::shared_ptr<Communicator> do_split(int color, int key, uint64_t seq) override {
    OpCall c = split_call(name(), rank(), color, key, seq);
    trace_->issued.store(seq);
    auto w = std::make_shared<WorkState>(c.desc, timeout());
    watchdog::watch(w, trace_);
    auto result = std::make_shared<std::shared_ptr<Communicator>>();
    const bool dbg = debug_checks();
    const std::string child = child_name(seq, color);
    exec_.submit(w, [this, c, dbg, color, key, child, result]() mutable {
      Progress p(*trace_, c.desc);
      if (dbg) debug_check(c, false);
      MPI_Comm sub = MPI_COMM_NULL;
      QUILT_CHECK_MPI(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub));
      if (sub != MPI_COMM_NULL) *result = create(sub, child, opts_);
    }, false);
    Work(w).wait();
    return *result;
  }

 private:
  // Marks the op started on entry and completed on exit, for the watchdog's side channel.
  struct Progress {
    CommTrace& t;
    uint64_t seq;
    Progress(CommTrace& tr, OpKind kind, uint64_t s) : t(tr), seq(s) {
      t.started_kind.store(int(kind), std::memory_order_release);
      t.started.store(s, std::memory_order_release);
    }
    Progress(CommTrace& tr, const OpDesc& d) : Progress(tr, d.kind, d.seq) {}
    ~Progress() { t.completed.store(seq, std::memory_order_release); }
  };

  // A synchronous collective with nothing queued before it: run on the caller's thread with no
  // WorkState, executor hand-off or watchdog entry; the inline slot keeps it watched. Errors
  // reach the caller as the Error a Work's wait() would throw.
  void run_inline(OpCall& c, bool dbg) {
    slot_->enter(c.desc, timeout());
    InlineSlot::Occupied occupied{*slot_};
    try {
      if (c.desc.delay.count() > 0) std::this_thread::sleep_for(c.desc.delay);
      run(c, dbg, /*polite=*/false);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(e.what());
    } catch (...) {
      throw Error("[" + std::string(op_kind_name(c.desc.kind)) + "] failed with an unknown exception");
    }
  }

  // The signatures' exchange, in the form of the op that follows (see wait_politely).
  void debug_check(const OpCall& c, bool polite) {
    std::vector<Signature> all(static_cast<size_t>(size()));
    const int n = int(sizeof(Signature));
    if (polite) {
      MPI_Request r = MPI_REQUEST_NULL;
      QUILT_CHECK_MPI(MPI_Iallgather(&c.sig, n, MPI_BYTE, all.data(), n, MPI_BYTE, comm_, &r));
      wait_politely(r);
    } else {
      QUILT_CHECK_MPI(MPI_Allgather(&c.sig, n, MPI_BYTE, all.data(), n, MPI_BYTE, comm_));
    }
    check_signatures(all, c.desc);
  }

  // Waits for `r` without holding a core: MPI_Test in a loop, then short sleeps growing to
  // kMaxNap between tests. For asynchronous collectives, which run on the op executor's thread:
  // a blocking MPI call there polls the whole time it waits for its peers (FSDP's prefetched
  // gathers wait for a whole layer of compute), taking CPU from the ranks' compute threads
  // wherever ranks share cores. MPI progress is global, so the caller's own MPI calls keep moving
  // this op between tests too. MPI never matches a nonblocking collective with a blocking one,
  // so the form follows async_op, which every rank passes alike (see communicator.h), never
  // where the op happens to run (a synchronous op queued behind asynchronous ones stays blocking).
  static void wait_politely(MPI_Request& r) {
    constexpr auto kMaxNap = std::chrono::microseconds(200);
    auto nap = std::chrono::microseconds(5);
    for (int polls = 0;; ++polls) {
      int done = 0;
      QUILT_CHECK_MPI(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
      if (done) return;
      if (polls < 200) continue;
      std::this_thread::sleep_for(nap);
      nap = std::min(kMaxNap, nap * 2);
    }
  }

  // `polite` (asynchronous ops): issue the nonblocking form and wait_politely; otherwise the
  // blocking call, where MPI's own wait is the fastest.
  void run(OpCall& c, bool dbg, bool polite) {
    Progress p(*trace_, c.desc);
    if (dbg) debug_check(c, polite);
    const OpDesc& d = c.desc;
    const DType dt = d.dtype;
    const MPI_Datatype type = mpi_type(dt);
    void* out = c.out.defined() ? c.out.data_ptr() : nullptr;
    const void* in = c.in.is_same(c.out) ? out : c.in.defined() ? c.in.data_ptr() : nullptr;  // in place: one lookup
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Request* const r = polite ? &req : nullptr;  // the nonblocking forms write here
    switch (d.kind) {
      case OpKind::all_reduce: {
        const int n = to_count(c.out.numel(), d);
        if (r) QUILT_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, out, n, type, mpi_op(dt, *d.rop), comm_, r));
        else call_blocking(d.kind, in, out, n, n, dt, d.rop, d.root);
        break;
      }
      case OpKind::broadcast: {
        const int n = to_count(c.out.numel(), d);
        if (r) QUILT_CHECK_MPI(MPI_Ibcast(out, n, type, d.root, comm_, r));
        else call_blocking(d.kind, in, out, n, n, dt, d.rop, d.root);
        break;
      }
      case OpKind::reduce:
        if (rank() == d.root) {
          const int n = to_count(c.out.numel(), d);
          if (r) QUILT_CHECK_MPI(MPI_Ireduce(MPI_IN_PLACE, out, n, type, mpi_op(dt, *d.rop), d.root, comm_, r));
          else QUILT_CHECK_MPI(MPI_Reduce(MPI_IN_PLACE, out, n, type, mpi_op(dt, *d.rop), d.root, comm_));
        } else {
          const int n = to_count(c.in.numel(), d);
          if (r) QUILT_CHECK_MPI(MPI_Ireduce(in, nullptr, n, type, mpi_op(dt, *d.rop), d.root, comm_, r));
          else QUILT_CHECK_MPI(MPI_Reduce(in, nullptr, n, type, mpi_op(dt, *d.rop), d.root, comm_));
        }
        break;
      case OpKind::all_gather: {
        const int n = to_count(c.in.numel(), d);
        if (r) QUILT_CHECK_MPI(MPI_Iallgather(in, n, type, out, n, type, comm_, r));
        else call_blocking(d.kind, in, out, n, n, dt, d.rop, d.root);
        break;
      }
      case OpKind::all_gather_v: {
        const std::vector<int> counts = to_counts(c.in_counts, d);
        const std::vector<int> displs = displacements(counts, d);
        const int n = counts[size_t(rank())];
        if (r) {
          QUILT_CHECK_MPI(MPI_Iallgatherv(in, n, type, out, counts.data(), displs.data(), type, comm_, r));
          wait_politely(*r);  // counts and displs must outlive the request
        } else {
          QUILT_CHECK_MPI(MPI_Allgatherv(in, n, type, out, counts.data(), displs.data(), type, comm_));
        }
        break;
      }
      case OpKind::reduce_scatter: {
        const int n = to_count(c.out.numel(), d);
        if (r) QUILT_CHECK_MPI(MPI_Ireduce_scatter_block(in, out, n, type, mpi_op(dt, *d.rop), comm_, r));
        else call_blocking(d.kind, in, out, n, n, dt, d.rop, d.root);
        break;
      }
      case OpKind::reduce_scatter_v: {
        const std::vector<int> counts = to_counts(c.in_counts, d);
        displacements(counts, d);  // checks the total fits an int
        if (r) {
          QUILT_CHECK_MPI(MPI_Ireduce_scatter(in, out, counts.data(), type, mpi_op(dt, *d.rop), comm_, r));
          wait_politely(*r);  // counts must outlive the request
        } else {
          QUILT_CHECK_MPI(MPI_Reduce_scatter(in, out, counts.data(), type, mpi_op(dt, *d.rop), comm_));
        }
        break;
      }
      case OpKind::all_to_all: {
        // A call without splits (made so on every rank, the API's contract) is MPI_Alltoall.
        // Otherwise the vector form, even where this rank's splits happen to be equal: that is a
        // per-rank fact (a rank that sends and receives nothing sees "all equal"), and
        // MPI_Alltoall on some ranks with MPI_Alltoallv on others never completes. Counts and
        // displacements live on the stack up to 64 ranks.
        if (c.even_splits) {
          const int ns = to_count(c.even_in, d), nr = to_count(c.even_out, d);
          if (r) QUILT_CHECK_MPI(MPI_Ialltoall(in, ns, type, out, nr, type, comm_, r));
          else call_blocking(d.kind, in, out, ns, nr, dt, d.rop, d.root);
          break;
        }
        const size_t n = c.in_counts.size();
        CountBuf sc(n), rc(n), sd(n), rd(n);
        int64_t sat = 0, rat = 0;
        for (size_t i = 0; i < n; ++i) {
          sc[i] = to_count(c.in_counts[i], d);
          rc[i] = to_count(c.out_counts[i], d);
          sd[i] = to_count(sat, d);
          rd[i] = to_count(rat, d);
          sat += c.in_counts[i];
          rat += c.out_counts[i];
        }
        if (r) {
          QUILT_CHECK_MPI(MPI_Ialltoallv(in, sc.data(), sd.data(), type, out, rc.data(), rd.data(), type, comm_, r));
          wait_politely(*r);  // the counts must outlive the request
        } else {
          QUILT_CHECK_MPI(MPI_Alltoallv(in, sc.data(), sd.data(), type, out, rc.data(), rd.data(), type, comm_));
        }
        break;
      }
      case OpKind::barrier:
        if (r) QUILT_CHECK_MPI(MPI_Ibarrier(comm_, r));
        else QUILT_CHECK_MPI(MPI_Barrier(comm_));
        break;
      default:
        fail("[mpi] unexpected op ", op_kind_name(d.kind));
    }
    if (req != MPI_REQUEST_NULL) wait_politely(req);
    // avg: the sum divided by the ranks, where this rank holds a reduced result.
    const bool reduced_here = d.kind == OpKind::all_reduce || d.kind == OpKind::reduce_scatter ||
                              d.kind == OpKind::reduce_scatter_v || (d.kind == OpKind::reduce && rank() == d.root);
    if (reduced_here && d.rop && *d.rop == ReduceOp::avg) divide_by(dt, out, c.out.numel(), size());
  }

  std::shared_ptr<WorkState> start_p2p(OpCall& c) {
    // A synchronous batch of up to 8 sends and receives: posted and waited for on the caller's
    // thread with no WorkState or watchdog entry (the p2p inline slot keeps it watched), unless
    // another thread is using the slot.
    if (!c.async && c.p2p.size() <= kInlineP2P && claim_p2p_slot()) {
      P2PClaim claim{p2p_busy_};
      p2p_slot_->enter(c.desc, timeout());
      InlineSlot::Occupied occupied{*p2p_slot_};
      P2PBuffer bufs[kInlineP2P];
      for (size_t i = 0; i < c.p2p.size(); ++i)
        bufs[i] = p2p_buffer(c.p2p[i].tensor, c.p2p[i].is_send, c.p2p[i].peer, c.p2p[i].tag);
      post_and_wait(bufs, c.p2p.size(), [&]() -> const OpDesc& { return c.desc; });
      return nullptr;
    }
    c.own();  // the work holds the buffers until its requests complete
    auto w = std::make_shared<MpiP2PWork>(c.desc, timeout());
    w->use_mpi_from_any_thread = g().multiple;
    for (P2PItem& it : c.p2p) {
      const MPI_Datatype type = mpi_type(it.tensor.dtype());
      const int n = to_count(it.tensor.numel(), c.desc);
      MPI_Request r = MPI_REQUEST_NULL;
      if (it.is_send) QUILT_CHECK_MPI(MPI_Isend(it.tensor.data_ptr(), n, type, it.peer, it.tag, comm_, &r));
      else QUILT_CHECK_MPI(MPI_Irecv(it.tensor.data_ptr(), n, type, it.peer, it.tag, comm_, &r));
      w->reqs.push_back(r);
      w->expected.push_back(it.is_send ? -1 : n);
      w->types.push_back(type);
      w->peers.push_back(it.peer);
      w->keep.push_back(it.tensor);
    }
    watchdog::watch(w, trace_);
    return w;
  }

  // The quick form of the inline batch above (see Communicator::run_quick).
  bool run_quick_p2p(const QuickOp& q) {
    if (q.p2p_count > kInlineP2P || !claim_p2p_slot()) return false;
    P2PClaim claim{p2p_busy_};
    p2p_slot_->enter(q, timeout());
    InlineSlot::Occupied occupied{*p2p_slot_};
    post_and_wait(q.p2p, q.p2p_count, [&] { return quick_desc(q); });
    return true;
  }

  // The description of a quick point-to-point op, to word its errors.
  OpDesc quick_desc(const QuickOp& q) const {
    OpDesc d;
    d.kind = q.kind;
    d.seq = q.seq;
    d.comm = CommName(name());
    d.rank = rank();
    d.has_tensor = q.shape != nullptr;
    d.dtype = q.dtype;
    if (q.shape) d.shape = *q.shape;
    d.root = q.root;
    d.tag = q.tag;
    return d;
  }

  bool claim_p2p_slot() {
    bool expected_free = false;
    return p2p_busy_.compare_exchange_strong(expected_free, true);
  }
  struct P2PClaim {
    std::atomic<bool>& busy;
    ~P2PClaim() { busy.store(false, std::memory_order_release); }
  };

  // Posts up to kInlineP2P sends and receives on the caller's thread and waits for them;
  // desc_of() gives the op's OpDesc, called only to word an error.
  template <class DescOf>
  void post_and_wait(const P2PBuffer* b, size_t n, DescOf&& desc_of) {
    MPI_Request reqs[kInlineP2P];
    MPI_Status st[kInlineP2P];
    MPI_Datatype types[kInlineP2P];
    int expected[kInlineP2P], peers[kInlineP2P], counts[kInlineP2P];
    for (size_t i = 0; i < n; ++i) {  // everything that can throw, before anything is posted
      types[i] = mpi_type(b[i].dtype);
      counts[i] = b[i].count <= INT_MAX ? int(b[i].count) : to_count(b[i].count, desc_of());
      expected[i] = b[i].is_send ? -1 : counts[i];
      peers[i] = b[i].peer;
    }
    int rc = MPI_SUCCESS;
    if (n <= 2 && (n == 1 || b[0].is_send != b[1].is_send)) {
      // One send, one receive, or one of each (an exchange): MPI's blocking call for exactly
      // that, without requests to create and wait for. (A single completion call does not set
      // its status's MPI_ERROR: the return code carries the error.)
      for (size_t i = 0; i < n; ++i) st[i].MPI_ERROR = MPI_SUCCESS;
      const size_t s = b[0].is_send ? 0 : 1, r = 1 - s;  // for n == 2
      if (n == 2)
        rc = MPI_Sendrecv(b[s].data, counts[s], types[s], b[s].peer, b[s].tag, b[r].data, counts[r], types[r],
                          b[r].peer, b[r].tag, comm_, &st[r]);
      else if (b[0].is_send)
        rc = MPI_Send(b[0].data, counts[0], types[0], b[0].peer, b[0].tag, comm_);
      else
        rc = MPI_Recv(b[0].data, counts[0], types[0], b[0].peer, b[0].tag, comm_, &st[0]);
    } else {
      for (size_t i = 0; i < n; ++i) {
        rc = b[i].is_send ? MPI_Isend(b[i].data, counts[i], types[i], b[i].peer, b[i].tag, comm_, &reqs[i])
                          : MPI_Irecv(b[i].data, counts[i], types[i], b[i].peer, b[i].tag, comm_, &reqs[i]);
        if (rc != MPI_SUCCESS) {  // withdraw what was posted, then report it as the asynchronous path does
          for (size_t j = 0; j < i; ++j) MPI_Cancel(&reqs[j]), MPI_Request_free(&reqs[j]);
          throw_mpi_error(rc, b[i].is_send ? "MPI_Isend" : "MPI_Irecv", __FILE__, __LINE__);
        }
      }
      rc = MPI_Waitall(int(n), reqs, st);
    }
    std::string failure = p2p_failure(desc_of, rc, st, n, expected, types, peers);
    if (!failure.empty()) throw Error(failure);
  }

  MPI_Comm comm_;
  CommOptions opts_;
  std::shared_ptr<CommTrace> trace_;
  std::shared_ptr<InlineSlot> slot_;      // synchronous collectives run inline
  std::shared_ptr<InlineSlot> p2p_slot_;  // synchronous point-to-point batches run inline
  std::atomic<bool> p2p_busy_{false};
  OpExecutor exec_;
};

// ---- the side channel (runs on the watchdog thread) ----
void post_query_recv() {
  MPI_Irecv(&g().query_buf, int(sizeof(Query)), MPI_BYTE, MPI_ANY_SOURCE, kQueryTag, g().watch, &g().query_req);
}

Reply local_reply(uint64_t uid) {
  Reply r;
  r.uid = uid;
  if (auto t = watchdog::find_trace(uid)) {
    r.found = 1;
    r.issued = t->issued.load();
    r.started = t->started.load();
    r.completed = t->completed.load();
    r.started_kind = t->started_kind.load();
  }
  return r;
}

// A peer's failure notice ends this process (its main thread may be blocked in MPI, waiting for
// the rank that failed): print it when loud and this rank logs, acknowledge it, then wait for
// the launcher to end the job as the failing rank exits (or end on our own, for launchers that
// do not). Acknowledging after printing lets the failing rank exit only once the relayed line
// is out, so it is never cut off.
void serve_failure_notices() {
  Globals& s = g();
  if (s.notice_req == MPI_REQUEST_NULL)
    MPI_Irecv(s.notice_buf, kNoticeBytes, MPI_BYTE, MPI_ANY_SOURCE, kFailureTag, s.watch, &s.notice_req);
  int flag = 0;
  MPI_Status st;
  if (MPI_Test(&s.notice_req, &flag, &st) != MPI_SUCCESS || !flag) return;
  int n = 0;
  MPI_Get_count(&st, MPI_BYTE, &n);
  if (n > 0 && s.notice_buf[0] == kLoud)
    log_text(concat("quilt: error: rank ", st.MPI_SOURCE, " failed: ", std::string(s.notice_buf + 1, size_t(n - 1))));
  std::fflush(stdout);
  std::fflush(stderr);
  static char ack = 1;
  MPI_Request r = MPI_REQUEST_NULL;
  MPI_Isend(&ack, 1, MPI_BYTE, st.MPI_SOURCE, kAckTag, s.watch, &r);
  const auto until = Clock::now() + kLauncherWait;
  while (Clock::now() < until) {
    if (r != MPI_REQUEST_NULL) MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::_Exit(1);
}

// Answers peers' queries and forgets replies that have been delivered.
void serve_queries() {
  Globals& s = g();
  serve_failure_notices();
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (s.query_req == MPI_REQUEST_NULL) post_query_recv();
    if (MPI_Test(&s.query_req, &flag, &st) != MPI_SUCCESS || !flag) break;
    auto reply = std::make_unique<Reply>(local_reply(s.query_buf.uid));
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_Isend(reply.get(), int(sizeof(Reply)), MPI_BYTE, st.MPI_SOURCE, kReplyTag, s.watch, &r);
    s.replies.emplace_back(r, std::move(reply));
    post_query_recv();
  }
  std::erase_if(s.replies, [](auto& p) {
    int flag = 0;
    MPI_Test(&p.first, &flag, MPI_STATUS_IGNORE);
    return flag != 0;
  });
}

std::string who_is_missing(const WorkState& w, const CommTrace& t) {
  Globals& s = g();
  const size_t n = t.world_ranks.size();
  // Heap buffers that are never freed: the job is aborted right after, possibly while a late
  // reply or a query is still in flight, and MPI must not write into a dead stack frame.
  auto& replies = *new std::vector<Reply>(n);
  auto& recv = *new std::vector<MPI_Request>(n, MPI_REQUEST_NULL);
  auto& send = *new std::vector<MPI_Request>(n, MPI_REQUEST_NULL);
  std::vector<char> answered(n, 0);
  Query& q = *new Query;
  q.uid = t.uid;
  // A collective asks every member; a single send/recv asks its peer only.
  const bool collective = is_collective(w.desc.kind);
  const bool single_p2p = w.desc.kind == OpKind::send || w.desc.kind == OpKind::recv;
  auto asked = [&](size_t i) { return !single_p2p || int(i) == w.desc.root; };
  for (size_t i = 0; i < n; ++i) {
    const int wr = t.world_ranks[i];
    if (!asked(i)) {
      answered[i] = 1;
      continue;
    }
    if (wr == s.world_rank) {
      replies[i] = local_reply(t.uid);
      answered[i] = 1;
      continue;
    }
    MPI_Irecv(&replies[i], int(sizeof(Reply)), MPI_BYTE, wr, kReplyTag, s.watch, &recv[i]);
    MPI_Isend(&q, int(sizeof(Query)), MPI_BYTE, wr, kQueryTag, s.watch, &send[i]);
  }
  const auto until = Clock::now() + kQueryGrace;
  while (Clock::now() < until) {
    serve_queries();  // peers that time out at the same moment ask us too
    bool all = true;
    for (size_t i = 0; i < n; ++i) {
      if (answered[i]) continue;
      int flag = 0;
      MPI_Test(&recv[i], &flag, MPI_STATUS_IGNORE);
      if (flag) answered[i] = 1;
      else all = false;
    }
    if (all) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::string missing, present;
  for (size_t i = 0; i < n; ++i) {
    if (!asked(i)) continue;
    const int wr = t.world_ranks[i];
    const std::string who = wr == int(i) ? concat(i) : concat(i, " (world rank ", wr, ")");
    std::string line;
    if (!answered[i]) {
      line = concat(who, " (did not answer within ", format_duration(kQueryGrace), ": stopped, dead or hung)");
    } else if (!replies[i].found) {
      line = t.name == "finalize" ? concat(who, " (has not reached finalize)")
                                  : concat(who, " (has no communicator ", t.name, ": not created yet, or destroyed)");
    } else if (!collective || replies[i].started < w.desc.seq) {
      line = watchdog::describe_progress(int(i), replies[i].started, int(replies[i].started_kind), replies[i].completed);
      if (wr != int(i)) line = concat("world rank ", wr, ": ", line);
    } else if (replies[i].started_kind != int(w.desc.kind) && replies[i].started == w.desc.seq) {
      line = concat(who, " (started ", op_kind_name(OpKind(replies[i].started_kind)), " #", replies[i].started,
                    " instead)");
    } else {
      present += concat(present.empty() ? "" : ", ", i);
      continue;
    }
    missing += concat(missing.empty() ? "" : ", ", line);
  }
  if (missing.empty()) return concat("none (ranks ", present, " all started it)");
  return collective ? missing : concat("(point to point) ", missing);
}

std::string thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "single";
    case MPI_THREAD_FUNNELED: return "funneled";
    case MPI_THREAD_SERIALIZED: return "serialized";
    case MPI_THREAD_MULTIPLE: return "multiple";
  }
  return "unknown";
}

}  // namespace

bool mpi_announce_failure(const std::string& message, bool printed) {
  Globals& s = g();
  if (!s.initialized || s.finalized || !s.multiple) return false;
  // Never freed: the process ends right after, possibly with a notice still in flight.
  auto& buf = *new std::string(1, printed ? kQuiet : kLoud);
  buf += message.substr(0, kNoticeBytes - 1);
  auto& acks = *new std::vector<char>(size_t(s.world_size));
  auto& reqs = *new std::vector<MPI_Request>();
  for (int r = 0; r < s.world_size; ++r) {
    if (r == s.world_rank) continue;
    MPI_Request q = MPI_REQUEST_NULL, a = MPI_REQUEST_NULL;
    if (MPI_Irecv(&acks[size_t(r)], 1, MPI_BYTE, r, kAckTag, s.watch, &a) == MPI_SUCCESS) reqs.push_back(a);
    if (MPI_Isend(buf.data(), int(buf.size()), MPI_BYTE, r, kFailureTag, s.watch, &q) == MPI_SUCCESS) reqs.push_back(q);
  }
  // Every peer acknowledges once it has printed what it prints; a peer that is gone or stopped
  // never does, so the wait is bounded.
  const auto until = Clock::now() + kAckWait;
  int done = 0;
  while (!done && Clock::now() < until) {
    if (MPI_Testall(int(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) break;
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

void mpi_abort_world(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

MpiWorld mpi_init_world(const CommOptions& opts, const std::string& launcher) {
  Globals& s = g();
  QUILT_CHECK(!s.initialized, "[launch] MPI is already initialised by Quilt");
  int inited = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&inited);
  if (!inited) {
    // QUILT_MPI_THREAD_LEVEL asks for less than MULTIPLE (to test the fallback, or for MPIs
    // whose multi-threaded mode is slow).
    int wanted = MPI_THREAD_MULTIPLE;
    if (const char* env = std::getenv("QUILT_MPI_THREAD_LEVEL"); env && *env) {
      const std::string lvl = env;
      QUILT_CHECK(lvl == "single" || lvl == "funneled" || lvl == "serialized" || lvl == "multiple",
                  "[launch] QUILT_MPI_THREAD_LEVEL must be single, funneled, serialized or multiple, got '", lvl, "'");
      wanted = lvl == "single" ? MPI_THREAD_SINGLE
               : lvl == "funneled" ? MPI_THREAD_FUNNELED
               : lvl == "serialized" ? MPI_THREAD_SERIALIZED
                                     : MPI_THREAD_MULTIPLE;
    }
    QUILT_CHECK_MPI(MPI_Init_thread(nullptr, nullptr, wanted, &provided));
    s.we_initialized = true;
  } else {
    MPI_Query_thread(&provided);
  }
  s.multiple = provided >= MPI_THREAD_MULTIPLE;
  MPI_Comm_rank(MPI_COMM_WORLD, &s.world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &s.world_size);
  set_log_rank(s.world_rank);

  QUILT_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &s.bf16));
  QUILT_CHECK_MPI(MPI_Type_commit(&s.bf16));
  QUILT_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &s.f16));
  QUILT_CHECK_MPI(MPI_Type_commit(&s.f16));
  QUILT_CHECK_MPI(MPI_Op_create(&user_sum, 1, &s.op_sum));
  QUILT_CHECK_MPI(MPI_Op_create(&user_max, 1, &s.op_max));
  QUILT_CHECK_MPI(MPI_Op_create(&user_min, 1, &s.op_min));
  QUILT_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &s.watch));
  // A peer that has already exited must not turn a failure notice into an MPI abort banner.
  MPI_Comm_set_errhandler(s.watch, MPI_ERRORS_RETURN);

  MpiWorld out;
  MPI_Comm local = MPI_COMM_NULL;
  QUILT_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, s.world_rank, MPI_INFO_NULL, &local));
  MPI_Comm_rank(local, &out.info.local_rank);
  MPI_Comm_size(local, &out.info.local_size);
  MPI_Comm_free(&local);
  out.info.rank = s.world_rank;
  out.info.world_size = s.world_size;
  out.info.launcher = launcher;
  out.info.mpi_thread_level = thread_level_name(provided);

  MPI_Comm world = MPI_COMM_NULL;
  QUILT_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &world));
  out.world = MpiCommunicator::create(world, "world", opts);
  s.initialized = true;

  watchdog::Hooks hooks;
  if (s.multiple) {
    hooks.tick = serve_queries;
    hooks.who_is_missing = who_is_missing;
  }
  hooks.abort_job = [] { MPI_Abort(MPI_COMM_WORLD, 3); };
  watchdog::start(std::move(hooks));
  return out;
}

void mpi_finalize_world() {
  Globals& s = g();
  if (!s.initialized || s.finalized) return;
  std::vector<std::shared_ptr<MpiCommunicator>> live;
  {
    std::lock_guard lk(s.mu);
    for (auto& w : s.comms)
      if (auto c = w.lock()) live.push_back(std::move(c));
  }
  for (auto& c : live) c->drain();  // under the watchdog: a stuck op still aborts

  // A last barrier, watched like any collective, so a rank that finishes early waits here for
  // the others (and is reported as "finished" if they are stuck) instead of in MPI_Finalize.
  auto trace = std::make_shared<CommTrace>();
  trace->name = "finalize";
  trace->uid = stable_hash(trace->name);
  trace->world_ranks.resize(size_t(s.world_size));
  std::iota(trace->world_ranks.begin(), trace->world_ranks.end(), 0);
  watchdog::register_trace(trace);
  OpDesc d;
  d.kind = OpKind::barrier;
  d.seq = 1;
  d.comm = "finalize";
  d.rank = s.world_rank;
  // Longer than an op's timeout: ranks stuck in a real collective fire first and name it.
  const auto op_timeout = live.empty() ? resolved_timeout({}) : live.front()->timeout();
  auto w = std::make_shared<WorkState>(d, op_timeout + std::chrono::seconds(5));
  trace->issued.store(1);
  trace->started_kind.store(int(OpKind::barrier));
  trace->started.store(1);
  watchdog::watch(w, trace);
  if (s.multiple) {
    MPI_Request r = MPI_REQUEST_NULL;
    MPI_Ibarrier(s.watch, &r);
    int flag = 0;
    while (!flag) {
      MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
      if (!flag) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  } else {
    MPI_Barrier(s.watch);
  }
  trace->completed.store(1);
  w->mark_done();

  watchdog::stop();
  for (MPI_Request* r : {&s.query_req, &s.notice_req}) {
    if (*r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(r);
    MPI_Wait(r, MPI_STATUS_IGNORE);
  }
  for (auto& [r, buf] : s.replies) {
    int flag = 0;
    MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    if (!flag) MPI_Request_free(&r);
  }
  s.replies.clear();
  for (auto& c : live) c->shutdown();
  live.clear();
  MPI_Comm_free(&s.watch);
  MPI_Op_free(&s.op_sum);
  MPI_Op_free(&s.op_max);
  MPI_Op_free(&s.op_min);
  MPI_Type_free(&s.bf16);
  MPI_Type_free(&s.f16);
  s.finalized = true;
  if (s.we_initialized) MPI_Finalize();
}

}  // namespace quilt::detail
