// The backend-independent half of every collective: argument checks, sequence numbers,
// contiguous/host staging of tensors, and the Work handle, state and in-order executor.
#include "collectives/communicator.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <map>
#include <numeric>
#include <sstream>
#include <unordered_set>

#include "collectives/internal.h"
#include "collectives/observer.h"
#include "engine/trace.h"
#include "engine/autograd.h"
#include "engine/random.h"

namespace quilt {

using detail::OpCall;
using detail::OpDesc;
using detail::OpKind;

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

std::chrono::milliseconds resolved_timeout(const CommOptions& opts) {
  if (opts.timeout) {
    QUILT_CHECK(opts.timeout->count() > 0, "[communicator] timeout must be positive, got ", opts.timeout->count(),
                " ms");
    return *opts.timeout;
  }
  if (const char* env = std::getenv("QUILT_COMM_TIMEOUT_S"); env && *env) {
    char* end = nullptr;
    const double s = std::strtod(env, &end);
    QUILT_CHECK(end && *end == '\0' && s > 0, "[communicator] QUILT_COMM_TIMEOUT_S must be a positive number of ",
                "seconds, got '", env, "'");
    return std::chrono::milliseconds(std::max<int64_t>(1, int64_t(s * 1000.0)));
  }
  return std::chrono::minutes(10);
}

bool resolved_debug_checks(const CommOptions& opts) {
  if (opts.debug_checks) return *opts.debug_checks;
  const char* env = std::getenv("QUILT_COMM_DEBUG");
  return env && *env && std::string(env) != "0";
}

namespace detail {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::all_reduce: return "all_reduce";
    case OpKind::broadcast: return "broadcast";
    case OpKind::reduce: return "reduce";
    case OpKind::all_gather: return "all_gather";
    case OpKind::all_gather_v: return "all_gather_v";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::reduce_scatter_v: return "reduce_scatter_v";
    case OpKind::all_to_all: return "all_to_all_single";
    case OpKind::barrier: return "barrier";
    case OpKind::split: return "split";
    case OpKind::send: return "send";
    case OpKind::recv: return "recv";
    case OpKind::batch_p2p: return "batch_p2p";
  }
  return "?";
}

std::string format_duration(std::chrono::milliseconds d) {
  std::ostringstream os;
  if (d.count() < 1000) os << d.count() << " ms";
  else if (d.count() % 1000 == 0) os << d.count() / 1000 << " s";
  else os << double(d.count()) / 1000.0 << " s";
  return os.str();
}

const std::string* CommName::intern(const std::string& name) {
  // Never destroyed: descriptions may be read by the watchdog thread during static destruction.
  static std::mutex* mu = new std::mutex;
  static auto* names = new std::unordered_set<std::string>;  // nodes never move
  std::lock_guard lk(*mu);
  return &*names->insert(name).first;
}

CommName::CommName(const std::string& name) : s_(intern(name)) {}

const std::string& CommName::empty() {
  static const std::string* e = intern("");
  return *e;
}

std::string OpDesc::short_str() const {
  return detail::concat(op_kind_name(kind), is_collective(kind) ? " #" : " p2p#", seq);
}

std::string OpDesc::str() const {
  std::ostringstream os;
  os << short_str() << " on " << comm << " (";
  const char* sep = "";
  if (has_tensor) {
    os << "shape " << detail::concat(shape.vec()) << ", " << dtype_name(dtype);
    sep = ", ";
  }
  if (rop) { os << sep << reduce_op_name(*rop); sep = ", "; }
  if (kind == OpKind::broadcast || kind == OpKind::reduce) { os << sep << "root " << root; sep = ", "; }
  if (kind == OpKind::send) { os << sep << "to rank " << root << ", tag " << tag; sep = ", "; }
  if (kind == OpKind::recv) { os << sep << "from rank " << root << ", tag " << tag; sep = ", "; }
  if (kind == OpKind::batch_p2p) { os << sep << root << " transfers"; sep = ", "; }
  os << sep << "rank " << rank << ")";
  return os.str();
}

std::string Signature::str() const {
  std::ostringstream os;
  os << op_kind_name(OpKind(kind)) << " #" << seq;
  if (ndim >= 0) {
    os << " with " << (trailing_only ? "rows of shape (*" : "shape (");
    const int shown = std::min(ndim, 8);
    for (int i = 0; i < shown; ++i) os << (i || trailing_only ? ", " : "") << dims[i];
    if (ndim > 8) os << ", ...";
    if (ndim == 1 && !trailing_only) os << ',';
    os << "), " << dtype_name(DType(dtype));
  }
  if (rop >= 0) os << ", " << reduce_op_name(ReduceOp(rop));
  if (root >= 0) os << ", root " << root;
  return os.str();
}

void check_signatures(const std::vector<Signature>& all, const OpDesc& d) {
  if (all.size() < 2) return;
  // The reference is the signature most ranks hold (ties: the lowest rank's), so one odd rank
  // is named even when it is rank 0.
  size_t ref = 0, best = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const size_t c = size_t(std::count(all.begin(), all.end(), all[i]));
    if (c > best) { best = c; ref = i; }
  }
  if (best == all.size()) return;
  std::vector<int> differing;
  for (size_t i = 0; i < all.size(); ++i)
    if (!(all[i] == all[ref])) differing.push_back(int(i));
  const Signature& bad = all[size_t(differing[0])];
  std::string why;
  Signature a = bad, b = all[ref];
  a.extra_hash = b.extra_hash = 0;
  if (a == b) why = " (their per-rank row sizes differ)";
  fail("[", op_kind_name(d.kind), "] ranks disagree on collective #", d.seq, " of ", d.comm, ": rank ",
       differing[0], " calls ", bad.str(), " but rank ", ref, " calls ", all[ref].str(), why,
       differing.size() > 1 ? "; all differing ranks: " : "", differing.size() > 1 ? detail::concat(differing) : "");
}

// ---- WorkState ----
WorkState::WorkState(OpDesc d, std::chrono::milliseconds t)
    : desc(std::move(d)), timeout(t), issued(Clock::now()), deadline(issued + t) {}

WorkState::~WorkState() = default;

void WorkState::mark_done() {
  std::lock_guard lk(mu_);
  if (status_.load(std::memory_order_relaxed) != 0) return;
  status_.store(1, std::memory_order_release);
  cv_.notify_all();
}

void WorkState::mark_failed(std::string message) {
  std::lock_guard lk(mu_);
  if (status_.load(std::memory_order_relaxed) != 0) return;
  error_ = std::move(message);
  status_.store(2, std::memory_order_release);
  cv_.notify_all();
}

std::string WorkState::error() const {
  std::lock_guard lk(mu_);
  return error_;
}

bool WorkState::poll() { return done_flag(); }

bool WorkState::block_until(std::optional<Clock::time_point> until) {
  std::unique_lock lk(mu_);
  if (!until) {
    cv_.wait(lk, [&] { return status_.load(std::memory_order_acquire) != 0; });
    return true;
  }
  return cv_.wait_until(lk, *until, [&] { return status_.load(std::memory_order_acquire) != 0; });
}

void WorkState::finish() {
  if (failed()) throw Error(error());
  std::vector<std::function<void()>> todo;
  {
    std::lock_guard lk(mu_);
    if (copied_back_) return;
    copied_back_ = true;
    todo.swap(copy_back);
  }
  for (auto& f : todo) f();
}

// ---- OpExecutor ----
OpExecutor::~OpExecutor() { stop(); }

void OpExecutor::run(const std::shared_ptr<WorkState>& w, Body& body) {
  try {
    if (w->desc.delay.count() > 0) std::this_thread::sleep_for(w->desc.delay);
    body();
    w->mark_done();
  } catch (const std::exception& e) {
    w->mark_failed(e.what());
  } catch (...) {
    w->mark_failed("[" + std::string(op_kind_name(w->desc.kind)) + "] failed with an unknown exception");
  }
}

void OpExecutor::submit(const std::shared_ptr<WorkState>& w, Body body, bool async) {
  std::unique_lock lk(mu_);
  if (!async && !busy_ && queue_.empty()) {
    busy_ = true;
    lk.unlock();
    run(w, body);
    lk.lock();
    busy_ = false;
    cv_.notify_all();
    return;
  }
  queue_.emplace_back(w, std::move(body));
  outstanding_.fetch_add(1, std::memory_order_relaxed);
  if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
  cv_.notify_all();
}

void OpExecutor::loop() {
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return (stopping_ && queue_.empty()) || (!queue_.empty() && !busy_); });
    if (queue_.empty()) return;  // stopping
    auto item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    run(item.first, item.second);
    item = {};  // release buffers before reporting idle
    lk.lock();
    busy_ = false;
    outstanding_.fetch_sub(1, std::memory_order_release);
    cv_.notify_all();
  }
}

void OpExecutor::drain() {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
}

void OpExecutor::stop() {
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
    stopping_ = true;
    cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
}

OpCall split_call(const std::string& comm, int rank, int color, int key, uint64_t seq) {
  OpCall c;
  c.desc.kind = OpKind::split;
  c.desc.seq = seq;
  c.desc.comm = comm;
  c.desc.rank = rank;
  c.color = color;
  c.key = key;
  c.sig.seq = seq;
  c.sig.kind = int32_t(OpKind::split);
  c.sig.ndim = -1;
  return c;
}

}  // namespace detail

// ---- Work ----
void Work::wait() {
  if (!state_) return;
  state_->wait_for_use();
  state_->finish();
}

bool Work::wait_for(std::chrono::milliseconds timeout) {
  if (!state_) return true;
  if (!state_->block_until(detail::Clock::now() + timeout)) return false;
  state_->finish();
  return true;
}

bool Work::is_completed() const { return !state_ || state_->poll(); }

std::string Work::describe() const { return state_ ? state_->desc.str() : "no-op"; }

void wait_all(std::vector<Work>& works) {
  for (Work& w : works) w.wait();
}

// ---- Communicator ----
namespace {

// [lo, hi) byte range a tensor's elements span inside its storage.
std::pair<int64_t, int64_t> byte_extent(const Tensor& t) {
  int64_t lo = t.offset(), hi = t.offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t span = (t.size(d) - 1) * t.stride(d);
    if (span < 0) lo += span;
    else hi += span;
  }
  const int64_t es = int64_t(t.element_size());
  return {lo * es, (hi + 1) * es};
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.storage().id() != b.storage().id()) return false;
  auto [alo, ahi] = byte_extent(a);
  auto [blo, bhi] = byte_extent(b);
  return alo < bhi && blo < ahi;
}

// Whether a and b agree on every dim after dim 0 (and have at least one dim), without copies.
bool same_trailing(const Tensor& a, const Tensor& b) {
  const Shape &x = a.shape(), &y = b.shape();
  return !x.empty() && x.size() == y.size() && std::equal(x.begin() + 1, x.end(), y.begin() + 1);
}

// Elements per row along dim 0.
int64_t row_numel(const Tensor& t) {
  int64_t n = 1;
  for (size_t i = 1; i < t.shape().size(); ++i) n *= t.shape()[i];
  return n;
}

int64_t checked_sum(const std::vector<int64_t>& v, const char* op, const char* what) {
  int64_t s = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    QUILT_CHECK(v[i] >= 0, "[", op, "] ", what, " must be non-negative, got ", v[i], " for rank ", i, " in ", v);
    s += v[i];
  }
  return s;
}

uint64_t hash_counts(const std::vector<int64_t>& v) {
  std::string bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
  return stable_hash(bytes) | 1;  // never 0, so "no list" differs from an empty list
}

// What must agree across ranks: the full shape, or (variable-size ops) the dims after dim 0.
detail::Signature make_signature(const OpCall& c, const Tensor& subject, bool trailing_only) {
  detail::Signature s;
  s.seq = c.desc.seq;
  s.kind = int32_t(c.desc.kind);
  s.rop = c.desc.rop ? int32_t(*c.desc.rop) : -1;
  s.root = (c.desc.kind == OpKind::broadcast || c.desc.kind == OpKind::reduce) ? c.desc.root : -1;
  s.ndim = -1;
  if (subject.defined()) {
    const Shape& shape = subject.shape();
    const size_t skip = trailing_only && !shape.empty() ? 1 : 0;
    const int64_t* dims = shape.data() + skip;
    const size_t nd = shape.size() - skip;
    s.dtype = int32_t(subject.dtype());
    s.trailing_only = trailing_only;
    s.ndim = int32_t(nd);
    for (size_t i = 0; i < nd && i < 8; ++i) s.dims[i] = dims[i];
    s.shape_hash = stable_hash(std::string_view(reinterpret_cast<const char*>(dims), nd * sizeof(int64_t)));
  }
  return s;
}

}  // namespace

Communicator::Communicator(std::string backend, std::string name, int rank, int size, Device device,
                           const CommOptions& opts)
    : backend_(std::move(backend)), name_(detail::CommName::intern(name)), rank_(rank), size_(size),
      device_(device), timeout_(resolved_timeout(opts)), debug_(resolved_debug_checks(opts)) {}

Communicator::~Communicator() = default;

void Communicator::set_timeout(std::chrono::milliseconds t) {
  QUILT_CHECK(t.count() > 0, "[communicator] timeout must be positive, got ", t.count(), " ms");
  timeout_ = t;
}

std::string Communicator::child_name(uint64_t seq, int color) const {
  return detail::concat(*name_, ".split", seq, "[color ", color, "]");
}

void Communicator::check_root(int root, const char* op, const char* what) const {
  QUILT_CHECK(root >= 0 && root < size_, "[", op, "] ", what, " ", root, " is out of range for ", *name_, " of ",
              size_, " ranks");
}

OpCall Communicator::begin(int kind, const Tensor& subject, bool collective) {
  OpCall c;
  c.desc.kind = OpKind(kind);
  c.desc.seq = collective ? ++seq_ : ++p2p_seq_;
  c.desc.comm = detail::CommName::interned(name_);
  c.desc.rank = rank_;
  if (subject.defined()) {
    c.desc.has_tensor = true;
    c.desc.dtype = subject.dtype();
    c.desc.shape = subject.shape();
  }
  return c;
}

// The backends read and write the data only (raw pointers, never autograd ops), so a contiguous
// tensor already in the backend's memory goes as it is: no detached copy of its handle per call.
// Any other tensor goes through a contiguous copy where the backend reads: a GPU tensor's copy in
// page-locked host memory for a host backend (MPI), a host tensor's copy on the communicator's GPU
// for a device backend (NCCL), so a host scalar (a loss, a count) reduces over either.
bool Communicator::usable_as_is(const Tensor& t) const {
  if (!t.is_contiguous()) return false;
  return host_memory_only() ? !t.device().is_cuda() : t.device() == device_;
}

Device Communicator::staging_device(const Tensor& x, const char* op) const {
  if (host_memory_only()) return Device::cpu();
  QUILT_CHECK(!x.device().is_cuda() || x.device() == device_, "[", op, "] the ", backend_, " communicator ", *name_,
              " works on ", device_.str(), " (or host) tensors, got one on ", x.device().str());
  return device_;
}

namespace {
// An empty tensor of x's shape and dtype on `where`: page-locked when it is a GPU tensor's host
// copy, so the copies between them run at full speed.
Tensor staging_buffer(const Tensor& x, Device where) {
  return Tensor::empty(x.shape(), {.dtype = x.dtype(), .device = where, .pinned = !where.is_cuda() && x.device() != where});
}
}  // namespace

Tensor Communicator::prepare_input(const Tensor& t, const char* op) const {
  if (usable_as_is(t)) return t;
  NoGradGuard ng;
  Tensor x = t.detach();
  const Device where = staging_device(x, op);
  if (x.device() == where) return x.contiguous();
  Tensor staged = staging_buffer(x, where);
  staged.copy_(x);
  return staged;
}

Tensor Communicator::prepare_output(const Tensor& t, bool read_too, std::vector<std::function<void()>>& copy_back) const {
  if (usable_as_is(t)) return t;
  NoGradGuard ng;
  Tensor x = t.detach();
  const Device where = staging_device(x, "communicator");
  if (x.device() == where && x.is_contiguous()) return x;
  Tensor tmp = staging_buffer(x, where);
  if (read_too) tmp.copy_(x);
  copy_back.push_back([x, tmp]() mutable {
    NoGradGuard g;
    x.copy_(tmp);
  });
  return tmp;
}

bool Communicator::borrow_into(Tensor& slot, const Tensor*& owner, const Tensor& t) const {
  if (!usable_as_is(t)) return false;
  slot = detail::borrow(t);
  owner = &t;
  return true;
}

void Communicator::bind_in(OpCall& c, const Tensor& t, const Tensor& out, const char* op) const {
  if (overlaps(t, out)) c.in = prepare_input(t.clone(), op);
  else if (!borrow_into(c.in, c.in_owner, t)) c.in = prepare_input(t, op);
}

void Communicator::bind_out(OpCall& c, const Tensor& t, bool read_too,
                            std::vector<std::function<void()>>& copy_back) const {
  if (!borrow_into(c.out, c.out_owner, t)) c.out = prepare_output(t, read_too, copy_back);
}

void Communicator::bind_in_place(OpCall& c, const Tensor& t, bool read_too,
                                 std::vector<std::function<void()>>& copy_back) const {
  bind_out(c, t, read_too, copy_back);
  c.in = c.out;
  c.in_owner = c.out_owner;
}

namespace {
thread_local const CollectiveObserver* t_observer = nullptr;
// Observers alive on any thread: while there are none, a call need not look at its thread's.
std::atomic<int> g_observers{0};
}  // namespace

ScopedCollectiveObserver::ScopedCollectiveObserver(CollectiveObserver observer)
    : observer_(std::move(observer)), previous_(t_observer) {
  t_observer = &observer_;
  g_observers.fetch_add(1, std::memory_order_relaxed);
}

ScopedCollectiveObserver::~ScopedCollectiveObserver() {
  t_observer = previous_;
  g_observers.fetch_sub(1, std::memory_order_relaxed);
}

const CollectiveObserver* detail::current_collective_observer() { return t_observer; }

namespace {
// logging.trace's slice for a collective, from here until the returned scope goes. Out of line,
// as the observer's record below, so that the common path (neither on) keeps a small frame.
[[gnu::noinline]] std::unique_ptr<trace::Scope> trace_collective(const OpCall& call, const std::string& axis,
                                                                 const std::string& comm, int ranks, bool async_op) {
  auto scope = std::make_unique<trace::Scope>();
  scope->begin("collective", op_kind_name(call.desc.kind));
  const OpDesc& d = call.desc;
  scope->arg("bytes", d.has_tensor ? d.shape.numel() * int64_t(dtype_size(d.dtype)) : int64_t(0));
  scope->arg("axis", axis.empty() ? comm : axis);
  scope->arg("comm", comm);
  scope->arg("ranks", int64_t(ranks));
  scope->arg("seq", int64_t(d.seq));
  if (d.has_tensor) scope->arg("shape", detail::concat(d.shape.vec()));
  if (async_op) scope->arg("async", int64_t(1));
  return scope;
}

[[gnu::noinline]] std::chrono::milliseconds observe(const CollectiveObserver& observer, const OpDesc& d, int ranks,
                                                    bool async_op) {
  CollectiveRecord r;
  r.op = op_kind_name(d.kind);
  r.seq = d.seq;
  r.comm = d.comm;
  r.comm_size = ranks;
  r.dtype = d.dtype;
  r.shape = d.shape.vec();
  if (d.has_tensor) r.bytes = d.shape.numel() * int64_t(dtype_size(d.dtype));
  r.async = async_op;
  return observer(r);
}
}  // namespace

Work Communicator::launch(OpCall&& call, std::vector<std::function<void()>>&& copy_back, bool async_op) {
  call.async = async_op;
  if (async_op) call.own();  // it outlives this call (a synchronous op is waited for below)
  // logging.trace: the collective from issue to completion (to issue only when asynchronous).
  std::unique_ptr<trace::Scope> scope;
  if (trace::enabled()) scope = trace_collective(call, axis_, *name_, size_, async_op);
  if (g_observers.load(std::memory_order_relaxed) != 0 && t_observer)
    call.desc.delay = observe(*t_observer, call.desc, size_, async_op);
  std::shared_ptr<detail::WorkState> state = start(std::move(call));
  if (!state) {  // the backend completed it inside start (a synchronous op run inline)
    for (auto& f : copy_back) f();
    return Work();
  }
  state->copy_back = std::move(copy_back);
  Work w(state);
  if (!async_op) w.wait();
  return w;
}

// The quick form skips the call record, the staging and the Work; it needs what the general
// path would find trivial: nothing recording the op, both tensors usable as they are and not
// overlapping (else the input is copied first), counts that fit the backend's int, at most 8
// dims for the watchdog's slot. The sequence number is taken before the backend runs it and
// given back when the backend declines, so either path numbers the op alike.
bool Communicator::try_quick(detail::QuickOp& q, const Tensor& in, const Tensor& out, const Tensor& subject) {
  if (signs() || trace::enabled() || g_observers.load(std::memory_order_relaxed) != 0) return false;
  if (!usable_as_is(out) || (&in != &out && (!usable_as_is(in) || overlaps(in, out)))) return false;
  const Shape& shape = subject.shape();
  if (shape.size() > 8 || q.count > INT_MAX || q.recv_count > INT_MAX) return false;
  q.shape = &shape;
  q.out = out.data_ptr();
  q.in = &in == &out ? q.out : in.data_ptr();
  q.seq = ++seq_;
  if (run_quick(q)) return true;
  --seq_;
  return false;
}

Work Communicator::all_reduce(const Tensor& t, ReduceOp op, bool async_op) {
  QUILT_CHECK(t.defined(), "[all_reduce] got an undefined tensor");
  QUILT_CHECK(!(op == ReduceOp::avg && t.dtype() == DType::b8), "[all_reduce] avg is not defined for bool tensors");
  if (detail::QuickOp q(OpKind::all_reduce, t.dtype(), t.numel(), op);
      !async_op && try_quick(q, t, t, t))
    return Work();
  OpCall c = begin(int(OpKind::all_reduce), t, true);
  c.desc.rop = op;
  std::vector<std::function<void()>> back;
  bind_in_place(c, t, true, back);
  if (signs()) c.sig = make_signature(c, t, false);
  return launch(std::move(c), std::move(back), async_op);
}

Work Communicator::broadcast(const Tensor& t, int root, bool async_op) {
  QUILT_CHECK(t.defined(), "[broadcast] got an undefined tensor");
  check_root(root, "broadcast", "root");
  if (detail::QuickOp q(OpKind::broadcast, t.dtype(), t.numel(), std::nullopt, root);
      !async_op && try_quick(q, t, t, t))
    return Work();
  OpCall c = begin(int(OpKind::broadcast), t, true);
  c.desc.root = root;
  std::vector<std::function<void()>> back;
  bind_in_place(c, t, rank() == root, back);
  if (signs()) c.sig = make_signature(c, t, false);
  return launch(std::move(c), std::move(back), async_op);
}

Work Communicator::reduce(const Tensor& t, int root, ReduceOp op, bool async_op) {
  QUILT_CHECK(t.defined(), "[reduce] got an undefined tensor");
  check_root(root, "reduce", "root");
  QUILT_CHECK(!(op == ReduceOp::avg && t.dtype() == DType::b8), "[reduce] avg is not defined for bool tensors");
  OpCall c = begin(int(OpKind::reduce), t, true);
  c.desc.root = root;
  c.desc.rop = op;
  std::vector<std::function<void()>> back;
  if (rank() == root) c.in = c.out = prepare_output(t, true, back);
  else c.in = c.out = prepare_input(t, "reduce");  // read only: nothing to copy back
  if (signs()) c.sig = make_signature(c, t, false);
  return launch(std::move(c), std::move(back), async_op);
}

Work Communicator::all_gather(const Tensor& out, const Tensor& in, bool async_op) {
  QUILT_CHECK(out.defined() && in.defined(), "[all_gather] got an undefined tensor");
  QUILT_CHECK(out.dtype() == in.dtype(), "[all_gather] output is ", dtype_name(out.dtype()), " but input is ",
              dtype_name(in.dtype()));
  QUILT_CHECK(out.numel() == int64_t(size()) * in.numel(), "[all_gather] output of shape ", out.shape(), " (",
              out.numel(), " elements) cannot hold ", size(), " inputs of shape ", in.shape(), " on ", *name_);
  if (detail::QuickOp q(OpKind::all_gather, in.dtype(), in.numel()); !async_op && try_quick(q, in, out, in))
    return Work();
  OpCall c = begin(int(OpKind::all_gather), in, true);
  std::vector<std::function<void()>> back;
  bind_out(c, out, false, back);
  bind_in(c, in, out, "all_gather");
  if (signs()) c.sig = make_signature(c, in, false);
  return launch(std::move(c), std::move(back), async_op);
}

Work Communicator::all_gather_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& rows, bool async_op) {
  QUILT_CHECK(out.defined() && in.defined(), "[all_gather_v] got an undefined tensor");
  QUILT_CHECK(int(rows.size()) == size(), "[all_gather_v] needs one row count per rank (", size(), "), got ", rows);
  QUILT_CHECK(out.dtype() == in.dtype(), "[all_gather_v] output is ", dtype_name(out.dtype()), " but input is ",
              dtype_name(in.dtype()));
  QUILT_CHECK(same_trailing(in, out),
              "[all_gather_v] input of shape ", in.shape(), " and output of shape ", out.shape(),
              " must have the same dims after dim 0");
  const int64_t total = checked_sum(rows, "all_gather_v", "row counts");
  QUILT_CHECK(in.size(0) == rows[size_t(rank())], "[all_gather_v] rank ", rank(), " has ", in.size(0),
              " rows but rows[", rank(), "] = ", rows[size_t(rank())]);
  QUILT_CHECK(out.size(0) == total, "[all_gather_v] output has ", out.size(0), " rows, the row counts ", rows,
              " add up to ", total);
  OpCall c = begin(int(OpKind::all_gather_v), in, true);
  const int64_t row = row_numel(in);
  std::vector<std::function<void()>> back;
  bind_out(c, out, false, back);
  bind_in(c, in, out, "all_gather_v");
  for (int64_t r : rows) c.in_counts.push_back(r * row);
  if (signs()) c.sig = make_signature(c, in, true);
  if (signs()) c.sig.extra_hash = hash_counts(rows);
  return launch(std::move(c), std::move(back), async_op);
}

Work Communicator::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op, bool async_op) {
  QUILT_CHECK(out.defined() && in.defined(), "[reduce_scatter] got an undefined tensor");
  QUILT_CHECK(out.dtype() == in.dtype(), "[reduce_scatter] output is ", dtype_name(out.dtype()), " but input is ",
              dtype_name(in.dtype()));
  QUILT_CHECK(in.numel() == int64_t(size()) * out.numel(), "[reduce_scatter] input of shape ", in.shape(), " (",
              in.numel(), " elements) is not ", size(), " outputs of shape ", out.shape(), " on ", *name_);
  QUILT_CHECK(!(op == ReduceOp::avg && in.dtype() == DType::b8), "[reduce_scatter] avg is not defined for bool tensors");
  if (detail::QuickOp q(OpKind::reduce_scatter, out.dtype(), out.numel(), op);
      !async_op && try_quick(q, in, out, out))
    return Work();
  OpCall c = begin(int(OpKind::reduce_scatter), out, true);
  c.desc.rop = op;
  std::vector<std::function<void()>> back;
  bind_out(c, out, false, back);
  bind_in(c, in, out, "reduce_scatter");
  if (signs()) c.sig = make_signature(c, out, false);
  return launch(std::move(c), std::move(back), async_op);
}

Work Communicator::reduce_scatter_v(const Tensor& out, const Tensor& in, const std::vector<int64_t>& rows,
                                    ReduceOp op, bool async_op) {
  QUILT_CHECK(out.defined() && in.defined(), "[reduce_scatter_v] got an undefined tensor");
  QUILT_CHECK(int(rows.size()) == size(), "[reduce_scatter_v] needs one row count per rank (", size(), "), got ",
              rows);
  QUILT_CHECK(out.dtype() == in.dtype(), "[reduce_scatter_v] output is ", dtype_name(out.dtype()),
              " but input is ", dtype_name(in.dtype()));
  QUILT_CHECK(same_trailing(in, out),
              "[reduce_scatter_v] input of shape ", in.shape(), " and output of shape ", out.shape(),
              " must have the same dims after dim 0");
  QUILT_CHECK(!(op == ReduceOp::avg && in.dtype() == DType::b8), "[reduce_scatter_v] avg is not defined for bool tensors");
  const int64_t total = checked_sum(rows, "reduce_scatter_v", "row counts");
  QUILT_CHECK(in.size(0) == total, "[reduce_scatter_v] input has ", in.size(0), " rows, the row counts ", rows,
              " add up to ", total);
  QUILT_CHECK(out.size(0) == rows[size_t(rank())], "[reduce_scatter_v] rank ", rank(), " output has ", out.size(0),
              " rows but rows[", rank(), "] = ", rows[size_t(rank())]);
  OpCall c = begin(int(OpKind::reduce_scatter_v), out, true);
  c.desc.rop = op;
  const int64_t row = row_numel(in);
  std::vector<std::function<void()>> back;
  bind_out(c, out, false, back);
  bind_in(c, in, out, "reduce_scatter_v");
  for (int64_t r : rows) c.in_counts.push_back(r * row);
  if (signs()) c.sig = make_signature(c, out, true);
  if (signs()) c.sig.extra_hash = hash_counts(rows);
  return launch(std::move(c), std::move(back), async_op);
}

Work Communicator::all_to_all_single(const Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                                     const std::vector<int64_t>& in_splits, bool async_op) {
  QUILT_CHECK(out.defined() && in.defined(), "[all_to_all_single] got an undefined tensor");
  QUILT_CHECK(out.dtype() == in.dtype(), "[all_to_all_single] output is ", dtype_name(out.dtype()),
              " but input is ", dtype_name(in.dtype()));
  QUILT_CHECK(same_trailing(in, out),
              "[all_to_all_single] input of shape ", in.shape(), " and output of shape ", out.shape(),
              " must have the same dims after dim 0");
  // Element counts per rank (row counts times the row size), validated before the op is numbered.
  const int64_t row = row_numel(in);
  auto even_block = [&](const Tensor& t, const char* what) {
    const int64_t rows = t.shape()[0];  // same_trailing: at least one dim
    QUILT_CHECK(rows % size_ == 0, "[all_to_all_single] ", what, " has ", rows,
                " rows, which do not split evenly over ", size_, " ranks; pass ", what, "_splits");
    return rows / size_ * row;
  };
  auto counts_of = [&](const std::vector<int64_t>& given, const Tensor& t, const char* what) {
    if (given.empty()) return std::vector<int64_t>(size_t(size_), even_block(t, what));
    QUILT_CHECK(int(given.size()) == size(), "[all_to_all_single] needs one ", what, " split per rank (", size(),
                "), got ", given);
    const int64_t total = checked_sum(given, "all_to_all_single", "splits");
    QUILT_CHECK(total == t.shape()[0], "[all_to_all_single] ", what, "_splits ", given, " add up to ", total,
                " but the ", what, " has ", t.shape()[0], " rows");
    std::vector<int64_t> counts(given.size());
    for (size_t i = 0; i < given.size(); ++i) counts[i] = given[i] * row;
    return counts;
  };
  // Without splits one block size stands for every rank's: no per-rank lists on the small-call path.
  const bool even = out_splits.empty() && in_splits.empty();
  const int64_t even_out = even ? even_block(out, "output") : 0;
  const int64_t even_in = even ? even_block(in, "input") : 0;
  if (even && !async_op) {
    detail::QuickOp q(OpKind::all_to_all, in.dtype(), even_in);
    q.recv_count = even_out;
    if (try_quick(q, in, out, in)) return Work();
  }
  std::vector<int64_t> oc = even ? std::vector<int64_t>() : counts_of(out_splits, out, "output");
  std::vector<int64_t> ic = even ? std::vector<int64_t>() : counts_of(in_splits, in, "input");
  OpCall c = begin(int(OpKind::all_to_all), in, true);
  std::vector<std::function<void()>> back;
  bind_out(c, out, false, back);
  bind_in(c, in, out, "all_to_all_single");
  c.in_counts = std::move(ic);
  c.out_counts = std::move(oc);
  c.even_splits = even;
  c.even_in = even_in;
  c.even_out = even_out;
  if (signs()) c.sig = make_signature(c, in, true);
  return launch(std::move(c), std::move(back), async_op);
}

Work Communicator::barrier(bool async_op) {
  OpCall c = begin(int(OpKind::barrier), Tensor(), true);
  if (signs()) c.sig = make_signature(c, Tensor(), false);
  return launch(std::move(c), {}, async_op);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  const uint64_t seq = ++seq_;
  return do_split(color, key, seq);
}

Work Communicator::send(const Tensor& t, int peer, int tag, bool async_op) {
  return batch_p2p({P2POp::send(t, peer, tag)}, async_op);
}

Work Communicator::recv(const Tensor& t, int peer, int tag, bool async_op) {
  return batch_p2p({P2POp::recv(t, peer, tag)}, async_op);
}

Work Communicator::batch_p2p(const std::vector<P2POp>& ops, bool async_op) {
  return batch_p2p(ops.data(), ops.size(), async_op);
}

Work Communicator::batch_p2p(std::initializer_list<P2POp> ops, bool async_op) {
  return batch_p2p(ops.begin(), ops.size(), async_op);
}

Work Communicator::batch_p2p(const P2POp* ops, size_t n, bool async_op) {
  // The quick path (see run_quick) takes a synchronous batch of up to kInlineP2P transfers on
  // tensors usable as they are, with nothing recording it; their buffers are resolved while the
  // ops are checked. Point-to-point ops are numbered apart and carry no signature.
  bool quick = !async_op && n <= detail::kInlineP2P && !trace::enabled() &&
               g_observers.load(std::memory_order_relaxed) == 0;
  detail::P2PBuffer bufs[detail::kInlineP2P];
  for (size_t i = 0; i < n; ++i) {
    const P2POp& op = ops[i];
    const bool is_send = op.kind == P2POp::Kind::send;
    const char* name = is_send ? "send" : "recv";
    QUILT_CHECK(op.tensor.defined(), "[", name, "] got an undefined tensor");
    if (op.peer < 0 || op.peer >= size_) check_root(op.peer, name, "peer");
    QUILT_CHECK(op.tag >= 0 && op.tag < (1 << 20), "[", name, "] tag ", op.tag, " is outside [0, 2^20)");
    quick = quick && usable_as_is(op.tensor);
    if (quick) bufs[i] = detail::p2p_buffer(op.tensor, is_send, op.peer, op.tag);
  }
  if (n == 0) return Work();
  const bool single = n == 1;
  const bool is_send = ops[0].kind == P2POp::Kind::send;
  OpKind kind = single ? (is_send ? OpKind::send : OpKind::recv) : OpKind::batch_p2p;
  if (quick) {
    // A single op's tensor is the one the watchdog shows.
    detail::QuickOp q(kind, ops[0].tensor.dtype(), 0, std::nullopt, single ? ops[0].peer : int(n));
    q.seq = ++p2p_seq_;
    q.shape = single ? &ops[0].tensor.shape() : nullptr;
    q.tag = single ? ops[0].tag : 0;
    q.p2p = bufs;
    q.p2p_count = n;
    if (run_quick(q)) return Work();
    --p2p_seq_;
  }
  static const Tensor kNone;
  OpCall c = begin(int(kind), single ? ops[0].tensor : kNone, false);
  c.desc.root = single ? ops[0].peer : int(n);
  c.desc.tag = single ? ops[0].tag : 0;
  std::vector<std::function<void()>> back;
  // The item list reuses this thread's previous batch's storage: no allocation per call.
  static thread_local std::vector<detail::P2PItem> spare;
  c.p2p.swap(spare);
  c.p2p.reserve(n);
  for (const P2POp* op = ops; op != ops + n; ++op) {
    detail::P2PItem item;
    item.is_send = op->kind == P2POp::Kind::send;
    item.peer = op->peer;
    item.tag = op->tag;
    if (!borrow_into(item.tensor, item.owner, op->tensor))
      item.tensor = item.is_send ? prepare_input(op->tensor, "send") : prepare_output(op->tensor, false, back);
    c.p2p.push_back(std::move(item));
  }
  Work w = launch(std::move(c), std::move(back), async_op);
  // A backend that ran the batch inline left the list here (one that queued it moved it away).
  c.p2p.clear();
  if (c.p2p.capacity() > spare.capacity()) c.p2p.swap(spare);
  return w;
}

}  // namespace quilt
