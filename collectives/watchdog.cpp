// The watchdog: one thread per process that watches every outstanding MPI/NCCL operation and,
// when one is still not complete at its deadline, prints the rank, the op, its sequence number,
// shape and dtype and the ranks that had not arrived (from the backend's side channel), then
// aborts the whole job. Never a silent hang. It also polls works nobody waits on (MPI requests,
// CUDA events) so they progress and release their buffers.
#include <cstdio>
#include <cstdlib>
#include <map>

#include "collectives/internal.h"

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

void loop() {
  State& s = state();
  std::unique_lock lk(s.mu);
  while (!s.stopping) {
    s.cv.wait_for(lk, kTick);
    if (s.stopping) break;
    Hooks hooks = s.hooks;
    std::vector<Entry> entries = s.entries;
    lk.unlock();
    if (hooks.tick) hooks.tick();
    const auto now = Clock::now();
    std::vector<const WorkState*> finished;
    for (const Entry& e : entries) {
      if (e.work->poll()) {
        finished.push_back(e.work.get());
      } else if (now >= e.work->deadline) {
        fire(e, hooks);
      }
    }
    entries.clear();
    lk.lock();
    if (!finished.empty())
      std::erase_if(s.entries, [&](const Entry& e) {
        return std::find(finished.begin(), finished.end(), e.work.get()) != finished.end();
      });
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
