// The in-process threads backend: N ranks as N threads sharing memory. Each collective is a
// rendezvous of all ranks (sequence-numbered, with the op's signature checked on every call);
// after arrival every rank reads its peers' buffers directly, and a departure barrier keeps
// those buffers alive until all have read (past it for a rank that timed out there: see
// Posted). Point-to-point messages are matched in per (source, destination, tag) FIFO channels
// with eager delivery, like MPI's non-overtaking rule.
// Timeouts throw an Error on every waiting rank naming the op and the ranks that had not arrived.
#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <tuple>

#include "collectives/internal.h"

namespace quilt {
namespace detail {
namespace {

constexpr auto kPollSlice = std::chrono::milliseconds(100);

class Group;

// Shared by a threads group and every group split from it: a failure of one rank abandons all.
struct Universe {
  std::atomic<bool> aborted{false};
  std::mutex mu;
  std::string reason;
  std::vector<std::weak_ptr<Group>> groups;
  void abort(const std::string& why);
  std::string why() {
    std::lock_guard lk(mu);
    return reason;
  }
};

// What a rank publishes for the collective in progress: its call, whose tensors, counts,
// signature and split color/key peers read from its arrival until the departure barrier.
// Holding the call keeps them alive: a rank whose departure wait times out leaves while a
// slower peer may still be reading them, and its caller may then drop every handle; the group
// holds them until the rank publishes again, which a broken group never lets it do.
using Posted = std::shared_ptr<const OpCall>;

class ThreadsP2PWork;

struct PendingRecv {
  std::shared_ptr<ThreadsP2PWork> work;
  Tensor tensor;
};

struct Message {
  std::vector<char> bytes;
  DType dtype = DType::f32;
  int64_t numel = 0;
};

struct Channel {
  std::deque<Message> messages;   // sent, not yet received
  std::deque<PendingRecv> recvs;  // posted, not yet matched
};

class Group {
 public:
  Group(int n_, std::string name_, std::shared_ptr<Universe> u)
      : n(n_), name(std::move(name_)), uni(std::move(u)), arrived(size_t(n_), 0), posted(size_t(n_)),
        entered_seq(size_t(n_), 0), entered_kind(size_t(n_), -1), split_result(size_t(n_)) {}

  const int n;
  const std::string name;
  const std::shared_ptr<Universe> uni;

  std::mutex mu;
  std::condition_variable cv;
  uint64_t gen = 0;
  int count = 0;
  std::vector<char> arrived;
  std::vector<Posted> posted;
  std::vector<uint64_t> entered_seq;
  std::vector<int> entered_kind;
  bool broken = false;
  std::string broken_reason;
  std::vector<std::shared_ptr<Group>> split_result;
  std::map<std::tuple<int, int, int>, Channel> channels;  // (src, dst, tag)

  // Throws when the group cannot make progress any more (an earlier timeout or a failed rank).
  void throw_if_dead(const OpDesc& d) {
    if (uni->aborted.load()) fail("[", op_kind_name(d.kind), "] ", d.short_str(), " on ", name, " abandoned: ", uni->why());
    if (broken) fail(broken_reason);
  }

  // Waits until all n ranks have called sync for the same phase; throws at the deadline
  // naming the ranks that had not arrived. `publish`, on arrival, becomes this rank's entry of
  // `posted` once the group is known to be alive (a dead group's entries may still be read).
  void sync(int rank, const OpDesc& d, Clock::time_point deadline, std::chrono::milliseconds timeout,
            const Posted* publish = nullptr) {
    std::unique_lock lk(mu);
    throw_if_dead(d);
    if (publish) posted[size_t(rank)] = *publish;
    entered_seq[size_t(rank)] = d.seq;
    entered_kind[size_t(rank)] = int(d.kind);
    const uint64_t my = gen;
    arrived[size_t(rank)] = 1;
    if (++count == n) {
      count = 0;
      ++gen;
      std::fill(arrived.begin(), arrived.end(), 0);
      cv.notify_all();
      return;
    }
    while (gen == my) {
      cv.wait_until(lk, std::min(deadline, Clock::now() + kPollSlice));
      if (gen != my) break;
      throw_if_dead(d);
      if (Clock::now() >= deadline) {
        std::string missing;
        for (int q = 0; q < n; ++q) {
          if (arrived[size_t(q)]) continue;
          missing += concat(missing.empty() ? "" : ", ", q, " (last entered ",
                            entered_kind[size_t(q)] < 0 ? std::string("nothing")
                                                        : concat(op_kind_name(OpKind(entered_kind[size_t(q)])), " #",
                                                                 entered_seq[size_t(q)]),
                            ")");
        }
        broken = true;
        broken_reason = concat("[", op_kind_name(d.kind), "] ", d.str(), " did not complete within ",
                               format_duration(timeout), "; ranks that had not arrived: ", missing);
        cv.notify_all();
        fail(broken_reason);
      }
    }
  }
};

void Universe::abort(const std::string& why) {
  std::vector<std::shared_ptr<Group>> live;
  {
    std::lock_guard lk(mu);
    if (aborted.load()) return;
    reason = why;
    aborted.store(true);
    for (auto& w : groups)
      if (auto g = w.lock()) live.push_back(std::move(g));
  }
  for (auto& g : live) {
    std::lock_guard lk(g->mu);
    g->cv.notify_all();
  }
}

// A send/recv batch: done when every receive of it has been matched.
class ThreadsP2PWork final : public WorkState {
 public:
  ThreadsP2PWork(OpDesc d, std::chrono::milliseconds t, std::shared_ptr<Group> g)
      : WorkState(std::move(d), t), group(std::move(g)) {}
  std::shared_ptr<Group> group;
  int pending = 0;  // guarded by group->mu

  bool block_until(std::optional<Clock::time_point> until) override {
    for (;;) {
      const auto now = Clock::now();
      auto limit = std::min(deadline, now + kPollSlice);
      if (until) limit = std::min(limit, *until);
      if (WorkState::block_until(limit)) return true;
      if (until && Clock::now() >= *until) return false;
      if (group->uni->aborted.load()) {
        forget();
        mark_failed(concat("[", op_kind_name(desc.kind), "] ", desc.short_str(), " on ", group->name,
                           " abandoned: ", group->uni->why()));
        return true;
      }
      if (Clock::now() >= deadline) {
        forget();
        mark_failed(concat("[", op_kind_name(desc.kind), "] ", desc.str(), " did not complete within ",
                           format_duration(timeout), ": no matching send arrived"));
        return true;
      }
    }
  }

 private:
  // Drops this work's unmatched receives so a late send is not swallowed by a dead receive.
  void forget() {
    std::lock_guard lk(group->mu);
    for (auto& [key, ch] : group->channels)
      std::erase_if(ch.recvs, [&](const PendingRecv& p) { return p.work.get() == this; });
  }
};

std::string size_mismatch(const OpDesc& d, int src, int dst, int tag, int64_t sent, DType sdt, int64_t want, DType rdt) {
  return concat("[", d.kind == OpKind::send ? "send" : "recv", "] rank ", src, " sent ", sent, " elements of ",
                dtype_name(sdt), " to rank ", dst, " (tag ", tag, ") but the receive expects ", want, " of ",
                dtype_name(rdt));
}

class ThreadsCommunicator final : public Communicator {
 public:
  ThreadsCommunicator(std::shared_ptr<Group> g, int rank, const CommOptions& opts, std::string backend)
      : Communicator(std::move(backend), g->name, rank, g->n, Device::cpu(), opts), g_(std::move(g)), opts_(opts) {}

  ~ThreadsCommunicator() override { exec_.stop(); }

  const std::shared_ptr<Group>& group() const { return g_; }

 protected:
  bool checks_every_call() const override { return true; }
  std::shared_ptr<WorkState> start(OpCall&& c) override {
    c.own();  // queued on the executor, or posted for peers to read
    if (!is_collective(c.desc.kind)) return start_p2p(c);
    // The equal-size forms arrive without per-rank counts; the copy loops below use them.
    if (c.desc.kind == OpKind::all_gather) c.in_counts.assign(size_t(size()), c.in.numel());
    if (c.desc.kind == OpKind::reduce_scatter) c.in_counts.assign(size_t(size()), c.out.numel());
    c.expand_even_splits(size());
    auto w = std::make_shared<WorkState>(c.desc, timeout());
    const bool async = c.async;
    exec_.submit(w, [this, call = std::make_shared<OpCall>(std::move(c)), wp = w.get()] { run_collective(call, *wp); },
                 async);
    return w;
  }

  std::shared_ptr<Communicator> do_split(int color, int key, uint64_t seq) override {
    auto c = std::make_shared<OpCall>(split_call(name(), rank(), color, key, seq));
    auto w = std::make_shared<WorkState>(c->desc, timeout());
    auto result = std::make_shared<std::shared_ptr<Communicator>>();
    exec_.submit(w, [this, c, result, wp = w.get(), seq] { *result = run_split(c, *wp, seq); }, false);
    Work(w).wait();
    return *result;
  }

 private:
  void run_collective(const std::shared_ptr<OpCall>& call, const WorkState& w);
  std::shared_ptr<Communicator> run_split(const std::shared_ptr<OpCall>& call, const WorkState& w, uint64_t seq);
  std::shared_ptr<WorkState> start_p2p(OpCall& c);
  // Arrival: publish, wait for all, check that every rank calls the same op. The returned
  // message is thrown after the departure barrier so no rank reads a peer's next publication.
  std::string arrive(const Posted& call, const WorkState& w);

  std::shared_ptr<Group> g_;
  CommOptions opts_;
  OpExecutor exec_;
};

std::string ThreadsCommunicator::arrive(const Posted& call, const WorkState& w) {
  const OpCall& c = *call;
  g_->sync(rank(), c.desc, w.deadline, w.timeout, &call);
  std::vector<Signature> sigs;
  for (const Posted& q : g_->posted) sigs.push_back(q->sig);
  try {
    check_signatures(sigs, c.desc);
  } catch (const Error& e) {
    return e.what();
  }
  if (c.desc.kind == OpKind::all_to_all) {
    // Every rank checks the whole send/receive matrix, so all of them fail together.
    for (int i = 0; i < size(); ++i)
      for (int j = 0; j < size(); ++j) {
        const int64_t sent = g_->posted[size_t(i)]->in_counts[size_t(j)];
        const int64_t want = g_->posted[size_t(j)]->out_counts[size_t(i)];
        if (sent != want)
          return concat("[all_to_all_single] ", c.desc.short_str(), " on ", name(), ": rank ", i, " sends ", sent,
                        " elements to rank ", j, ", which expects ", want, " from it (check the split sizes)");
      }
  }
  return {};
}

void ThreadsCommunicator::run_collective(const std::shared_ptr<OpCall>& call, const WorkState& w) {
  OpCall& c = *call;
  Group& g = *g_;
  const int r = rank(), n = size();
  const DType dt = c.desc.dtype;
  const size_t es = dtype_size(dt);
  char* out = c.out.defined() ? static_cast<char*>(c.out.data_ptr()) : nullptr;
  const int64_t numel = c.out.defined() ? c.out.numel() : 0;
  std::string err = arrive(call, w);
  auto peer_out = [&](int q) { return static_cast<char*>(g.posted[size_t(q)]->out.data_ptr()); };
  auto peer_in = [&](int q) { return static_cast<const char*>(g.posted[size_t(q)]->in.data_ptr()); };
  if (err.empty()) {
    switch (c.desc.kind) {
      case OpKind::all_reduce: {
        // Rank r reduces chunk r of everyone's tensor into its own, then copies the other
        // chunks from their owners: each element is read and written without a race.
        const int64_t N = numel;
        auto lo = [&](int q) { return N * q / n; };
        std::vector<const void*> srcs(static_cast<size_t>(n));
        for (int q = 0; q < n; ++q) srcs[size_t(q)] = peer_out(q) + lo(r) * int64_t(es);
        reduce_many(dt, *c.desc.rop, out + lo(r) * int64_t(es), srcs.data(), n, lo(r + 1) - lo(r));
        if (*c.desc.rop == ReduceOp::avg) divide_by(dt, out + lo(r) * int64_t(es), lo(r + 1) - lo(r), n);
        g.sync(r, c.desc, w.deadline, w.timeout);
        for (int q = 0; q < n; ++q)
          if (q != r && lo(q + 1) > lo(q))
            std::memcpy(out + lo(q) * int64_t(es), peer_out(q) + lo(q) * int64_t(es), size_t(lo(q + 1) - lo(q)) * es);
        break;
      }
      case OpKind::broadcast:
        if (r != c.desc.root && numel) std::memcpy(out, peer_out(c.desc.root), size_t(numel) * es);
        break;
      case OpKind::reduce:
        if (r == c.desc.root) {
          std::vector<const void*> srcs(static_cast<size_t>(n));
          for (int q = 0; q < n; ++q) srcs[size_t(q)] = peer_out(q);
          reduce_many(dt, *c.desc.rop, out, srcs.data(), n, numel);
          if (*c.desc.rop == ReduceOp::avg) divide_by(dt, out, numel, n);
        }
        break;
      case OpKind::all_gather:
      case OpKind::all_gather_v: {
        int64_t at = 0;
        for (int q = 0; q < n; ++q) {
          const int64_t k = c.in_counts[size_t(q)];
          if (k) std::memcpy(out + at * int64_t(es), peer_in(q), size_t(k) * es);
          at += k;
        }
        break;
      }
      case OpKind::reduce_scatter:
      case OpKind::reduce_scatter_v: {
        const int64_t at = std::accumulate(c.in_counts.begin(), c.in_counts.begin() + r, int64_t{0});
        const int64_t k = c.in_counts[size_t(r)];
        std::vector<const void*> srcs(static_cast<size_t>(n));
        for (int q = 0; q < n; ++q) srcs[size_t(q)] = peer_in(q) + at * int64_t(es);
        reduce_many(dt, *c.desc.rop, out, srcs.data(), n, k);
        if (*c.desc.rop == ReduceOp::avg) divide_by(dt, out, k, n);
        break;
      }
      case OpKind::all_to_all: {
        int64_t at = 0;
        for (int q = 0; q < n; ++q) {
          const auto& sc = g.posted[size_t(q)]->in_counts;
          const int64_t from = std::accumulate(sc.begin(), sc.begin() + r, int64_t{0});
          const int64_t k = c.out_counts[size_t(q)];
          if (k) std::memcpy(out + at * int64_t(es), peer_in(q) + from * int64_t(es), size_t(k) * es);
          at += k;
        }
        break;
      }
      case OpKind::barrier:
        break;
      default:
        err = concat("[threads] unexpected op ", op_kind_name(c.desc.kind));
    }
  }
  g.sync(r, c.desc, w.deadline, w.timeout);
  g.posted[size_t(r)].reset();  // every peer has left: nothing reads this rank's buffers now
  if (!err.empty()) throw Error(err);
}

std::shared_ptr<Communicator> ThreadsCommunicator::run_split(const std::shared_ptr<OpCall>& call, const WorkState& w,
                                                             uint64_t seq) {
  const OpCall& c = *call;
  Group& g = *g_;
  const int r = rank(), n = size();
  std::string err = arrive(call, w);
  if (err.empty() && r == 0) {
    // Rank 0 builds every new group; members pick theirs up after the middle barrier.
    std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, rank)
    for (int q = 0; q < n; ++q) {
      const OpCall& p = *g.posted[size_t(q)];
      if (p.color >= 0) by_color[p.color].push_back({p.key, q});
    }
    for (auto& [color, members] : by_color) {
      std::sort(members.begin(), members.end());
      auto child = std::make_shared<Group>(int(members.size()), child_name(seq, color), g.uni);
      {
        std::lock_guard lk(g.uni->mu);
        g.uni->groups.push_back(child);
      }
      for (auto& m : members) g.split_result[size_t(m.second)] = child;
    }
    for (int q = 0; q < n; ++q)
      if (g.posted[size_t(q)]->color < 0) g.split_result[size_t(q)] = nullptr;
  }
  std::shared_ptr<Group> mine;
  // My rank in the child: position of (key, rank) among the members of my color. Read before
  // the departure barrier: after it, peers may already publish their next collective.
  int my_rank = 0;
  if (err.empty()) {
    g.sync(r, c.desc, w.deadline, w.timeout);
    mine = g.split_result[size_t(r)];
    std::vector<std::pair<int, int>> members;
    for (int q = 0; q < n; ++q)
      if (g.posted[size_t(q)]->color == c.color) members.push_back({g.posted[size_t(q)]->key, q});
    std::sort(members.begin(), members.end());
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i].second == r) my_rank = int(i);
  }
  g.sync(r, c.desc, w.deadline, w.timeout);
  g.posted[size_t(r)].reset();
  if (!err.empty()) throw Error(err);
  if (!mine) return nullptr;
  return std::make_shared<ThreadsCommunicator>(mine, my_rank, opts_, backend());
}

std::shared_ptr<WorkState> ThreadsCommunicator::start_p2p(OpCall& c) {
  auto w = std::make_shared<ThreadsP2PWork>(c.desc, timeout(), g_);
  std::string err;
  {
    std::lock_guard lk(g_->mu);
    if (g_->uni->aborted.load() || g_->broken) {
      err = g_->uni->aborted.load() ? concat("[", op_kind_name(c.desc.kind), "] abandoned: ", g_->uni->why())
                                    : g_->broken_reason;
    }
    // Sends first, so a batch that sends and receives with the same peer cannot block itself.
    for (int pass = 0; pass < 2 && err.empty(); ++pass) {
      for (P2PItem& it : c.p2p) {
        if (it.is_send != (pass == 0)) continue;
        const int src = it.is_send ? rank() : it.peer;
        const int dst = it.is_send ? it.peer : rank();
        Channel& ch = g_->channels[{src, dst, it.tag}];
        const Tensor& t = it.tensor;
        const size_t bytes = t.nbytes();
        if (it.is_send) {
          if (!ch.recvs.empty()) {
            PendingRecv pr = std::move(ch.recvs.front());
            ch.recvs.pop_front();
            if (pr.tensor.numel() != t.numel() || pr.tensor.dtype() != t.dtype()) {
              std::string m = size_mismatch(c.desc, src, dst, it.tag, t.numel(), t.dtype(), pr.tensor.numel(),
                                            pr.tensor.dtype());
              pr.work->mark_failed(m);
              err = m;
              break;
            }
            if (bytes) std::memcpy(pr.tensor.data_ptr(), t.data_ptr(), bytes);
            if (--pr.work->pending == 0) pr.work->mark_done();
          } else {
            Message m;
            m.bytes.assign(static_cast<const char*>(t.data_ptr()), static_cast<const char*>(t.data_ptr()) + bytes);
            m.dtype = t.dtype();
            m.numel = t.numel();
            ch.messages.push_back(std::move(m));
          }
        } else if (!ch.messages.empty()) {
          Message m = std::move(ch.messages.front());
          ch.messages.pop_front();
          if (m.numel != t.numel() || m.dtype != t.dtype()) {
            err = size_mismatch(c.desc, src, dst, it.tag, m.numel, m.dtype, t.numel(), t.dtype());
            break;
          }
          if (bytes) std::memcpy(t.data_ptr(), m.bytes.data(), bytes);
        } else {
          ++w->pending;
          ch.recvs.push_back({w, t});
        }
      }
    }
    if (err.empty() && w->pending == 0) w->mark_done();
  }
  if (!err.empty()) w->mark_failed(err);
  return w;
}

struct ThreadsGroupHandle {
  std::vector<std::shared_ptr<Communicator>> comms;
  std::shared_ptr<Universe> universe;
};

ThreadsGroupHandle new_threads_group(int n, const CommOptions& opts, const std::string& backend) {
  QUILT_CHECK(n >= 1 && n <= 4096, "[threads] group size must be in [1, 4096], got ", n);
  ThreadsGroupHandle h;
  h.universe = std::make_shared<Universe>();
  auto g = std::make_shared<Group>(n, "world", h.universe);
  h.universe->groups.push_back(g);
  for (int r = 0; r < n; ++r) h.comms.push_back(std::make_shared<ThreadsCommunicator>(g, r, opts, backend));
  return h;
}

}  // namespace

std::shared_ptr<Communicator> make_local_communicator(const CommOptions& opts) {
  return new_threads_group(1, opts, "local").comms[0];
}

}  // namespace detail

std::vector<std::shared_ptr<Communicator>> make_threads_group(int n, const CommOptions& opts) {
  return detail::new_threads_group(n, opts, "threads").comms;
}

void run_threads_group(int n, const std::function<void(Communicator&)>& fn, const CommOptions& opts) {
  detail::ThreadsGroupHandle h = detail::new_threads_group(n, opts, "threads");
  std::mutex mu;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(size_t(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(*h.comms[size_t(r)]);
      } catch (const std::exception& e) {
        {
          std::lock_guard lk(mu);
          if (!first) first = std::current_exception();
        }
        h.universe->abort(detail::concat("rank ", r, " failed: ", e.what()));
      } catch (...) {
        {
          std::lock_guard lk(mu);
          if (!first) first = std::current_exception();
        }
        h.universe->abort(detail::concat("rank ", r, " failed with an unknown exception"));
      }
    });
  }
  for (auto& t : threads) t.join();
  // Async work some rank left behind unmatched fails now instead of at its timeout.
  h.universe->abort("the threads group has finished");
  h.comms.clear();
  if (first) std::rethrow_exception(first);
}

}  // namespace quilt
