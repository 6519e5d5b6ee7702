// The watchdog: one thread per process that watches every outstanding MPI/NCCL operation and,
// when one is still not complete at its deadline, prints the rank, the op, its sequence number,
// shape and dtype and the ranks that had not arrived (from the backend's side channel), then
// aborts the whole job. Never a silent hang. It also polls works nobody waits on (MPI requests,
// CUDA events) so they progress and release their buffers.
#include <cstdio>
#include <cstdlib>
#include <map>

#include "collectives/internal.h"
#include "engine/device.h"

namespace quilt::detail::watchdog {
namespace {

constexpr auto kTick = std::chrono::milliseconds(50);

struct Entry {
  std::shared_ptr<WorkState> work;
  std::shared_ptr<CommTrace> trace;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::thread thread;
  bool stopping = false;
  Hooks hooks;
  std::vector<Entry> entries;
  std::vector<std::weak_ptr<InlineSlot>> slots;
  std::map<uint64_t, std::function<void()>> abort_hooks;
  uint64_t next_hook = 1;
  std::map<uint64_t, std::weak_ptr<CommTrace>> traces;
};

// Never destroyed: the thread may outlive static destruction order otherwise.
State& state() {
  static State* s = new State();
  return *s;
}

[[noreturn]] void fire(const Entry& e, const Hooks& hooks) {
  const WorkState& w = *e.work;
  std::string missing = "unknown (no side channel)";
  if (hooks.who_is_missing && e.trace) {
    try {
      missing = hooks.who_is_missing(w, *e.trace);
    } catch (const std::exception& ex) {
      missing = concat("unknown (", ex.what(), ")");
    }
  }
  log_text_every_rank(concat("[watchdog] ", w.desc.str(), " did not complete within ", format_duration(w.timeout),
                             "; ranks that had not arrived: ", missing, "; aborting the job"));
  std::vector<std::function<void()>> pre;
  {
    State& s = state();
    std::lock_guard lk(s.mu);
    for (auto& [id, f] : s.abort_hooks) pre.push_back(f);
  }
  for (auto& f : pre) {
    try {
      f();
    } catch (...) {
    }
  }
  std::fflush(stdout);
  std::fflush(stderr);
  if (hooks.abort_job) hooks.abort_job();
  std::_Exit(3);
}

// An inline op that has run in its slot for at least its timeout (counted from the first tick
// that saw it, so never early) fires like a watched work.
void scan_slots(const std::vector<std::shared_ptr<InlineSlot>>& slots, Clock::time_point now, const Hooks& hooks) {
  for (const auto& sl : slots) {
    const uint64_t seq = sl->seq.load(std::memory_order_acquire);
    if (seq != sl->seen_seq) {
      sl->seen_seq = seq;
      sl->seen_at = now;
      continue;
    }
    if (seq == 0 || now - sl->seen_at < std::chrono::milliseconds(sl->timeout_ms.load(std::memory_order_relaxed)))
      continue;
    auto snap = sl->snapshot();
    if (!snap || snap->first.seq != seq) continue;  // it completed meanwhile
    fire(Entry{std::make_shared<WorkState>(std::move(snap->first), snap->second), sl->trace}, hooks);
  }
}

void loop() {
  State& s = state();
  std::unique_lock lk(s.mu);
  while (!s.stopping) {
    s.cv.wait_for(lk, kTick);
    if (s.stopping) break;
    Hooks hooks = s.hooks;
    std::vector<Entry> entries = s.entries;
    std::vector<std::shared_ptr<InlineSlot>> slots;
    std::erase_if(s.slots, [](const auto& w) { return w.expired(); });
    for (const auto& w : s.slots)
      if (auto sl = w.lock()) slots.push_back(std::move(sl));
    lk.unlock();
    if (hooks.tick) hooks.tick();
    if (cuda::capture_underway()) {  // no event may be queried during a capture; deadlines wait too
      entries.clear();
      slots.clear();
      lk.lock();
      continue;
    }
    const auto now = Clock::now();
    std::vector<char> finished(entries.size(), 0);
    bool any = false;
    for (size_t i = 0; i < entries.size(); ++i) {
      const Entry& e = entries[i];
      if (e.work->poll()) {
        finished[i] = 1;
        any = true;
      } else if (now >= e.work->deadline) {
        fire(e, hooks);
      }
    }
    scan_slots(slots, now, hooks);
    slots.clear();
    lk.lock();
    // Only this thread removes entries and watch() only appends, so the snapshot is still the
    // prefix of s.entries: drop its finished ones in one pass.
    if (any) {
      size_t w = 0;
      for (size_t i = 0; i < s.entries.size(); ++i)
        if (i >= finished.size() || !finished[i]) {
          if (w != i) s.entries[w] = std::move(s.entries[i]);
          ++w;
        }
      s.entries.resize(w);
    }
    lk.unlock();
    entries.clear();  // release the works' buffers outside the lock
    lk.lock();
  }
}

}  // namespace

void start(Hooks hooks) {
  State& s = state();
  std::lock_guard lk(s.mu);
  s.hooks = std::move(hooks);
  if (!s.thread.joinable()) {
    s.stopping = false;
    s.thread = std::thread(loop);
  }
}

void stop() {
  State& s = state();
  {
    std::lock_guard lk(s.mu);
    s.stopping = true;
    s.cv.notify_all();
  }
  if (s.thread.joinable()) s.thread.join();
  std::lock_guard lk(s.mu);
  s.entries.clear();
  s.hooks = {};
}

void watch(const std::shared_ptr<WorkState>& w, const std::shared_ptr<CommTrace>& trace) {
  State& s = state();
  std::lock_guard lk(s.mu);
  if (!s.thread.joinable()) {
    // Without a launcher (e.g. NCCL on one GPU in a test) nobody installed hooks: abort alone.
    s.stopping = false;
    s.thread = std::thread(loop);
  }
  s.entries.push_back({w, trace});
}

void watch_inline(const std::shared_ptr<InlineSlot>& slot) {
  State& s = state();
  std::lock_guard lk(s.mu);
  std::erase_if(s.slots, [](const auto& w) { return w.expired(); });
  s.slots.push_back(slot);
}

uint64_t add_abort_hook(std::function<void()> f) {
  State& s = state();
  std::lock_guard lk(s.mu);
  const uint64_t id = s.next_hook++;
  s.abort_hooks[id] = std::move(f);
  return id;
}

void remove_abort_hook(uint64_t id) {
  State& s = state();
  std::lock_guard lk(s.mu);
  s.abort_hooks.erase(id);
}

void register_trace(const std::shared_ptr<CommTrace>& t) {
  State& s = state();
  std::lock_guard lk(s.mu);
  std::erase_if(s.traces, [](const auto& kv) { return kv.second.expired(); });
  s.traces[t->uid] = t;
}

std::shared_ptr<CommTrace> find_trace(uint64_t uid) {
  State& s = state();
  std::lock_guard lk(s.mu);
  auto it = s.traces.find(uid);
  return it == s.traces.end() ? nullptr : it->second.lock();
}

size_t watched_count() {
  State& s = state();
  std::lock_guard lk(s.mu);
  return s.entries.size();
}

std::string describe_progress(int rank, uint64_t started, int started_kind, uint64_t completed) {
  std::string last = started == 0 || started_kind < 0
                         ? std::string("no collective started")
                         : concat("last started ", op_kind_name(OpKind(started_kind)), " #", started,
                                  started == completed ? ", completed" : ", not completed");
  return concat(rank, " (", last, ")");
}

}  // namespace quilt::detail::watchdog

namespace quilt::detail {

std::optional<std::pair<OpDesc, std::chrono::milliseconds>> InlineSlot::snapshot() const {
  const uint64_t s = seq.load(std::memory_order_acquire);
  if (s == 0) return std::nullopt;
  OpDesc d;
  d.seq = s;
  d.comm = comm;
  d.rank = rank;
  d.kind = OpKind(kind.load(std::memory_order_relaxed));
  const int32_t dt = dtype.load(std::memory_order_relaxed);
  d.has_tensor = dt >= 0;
  if (d.has_tensor) d.dtype = DType(dt);
  const int32_t r = rop.load(std::memory_order_relaxed);
  if (r >= 0) d.rop = ReduceOp(r);
  d.root = root.load(std::memory_order_relaxed);
  d.tag = tag.load(std::memory_order_relaxed);
  const int32_t nd = ndim.load(std::memory_order_relaxed);
  Shape shape;
  for (int32_t i = 0; i < nd && i < 8; ++i) shape.push_back(dims[i].load(std::memory_order_relaxed));
  d.shape = shape;
  const auto t = std::chrono::milliseconds(timeout_ms.load(std::memory_order_relaxed));
  std::atomic_thread_fence(std::memory_order_acquire);
  if (seq.load(std::memory_order_relaxed) != s) return std::nullopt;  // a newer op overwrote the fields
  return std::make_pair(std::move(d), t);
}

}  // namespace quilt::detail
