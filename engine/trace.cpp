// The trace store: see trace.h. One mutex-guarded list per process; threads get small ids in
// the order they first record.
#include "engine/trace.h"

#include <chrono>
#include <mutex>
#include <sstream>

namespace quilt::trace {
namespace detail {
std::atomic<bool> g_enabled{false};
}  // namespace detail

namespace {

using Clock = std::chrono::steady_clock;

struct Store {
  std::mutex mu;
  std::vector<Event> events;
  Clock::time_point origin = Clock::now();
  int next_tid = 0;
};

Store& store() {
  static Store* s = new Store();  // never destroyed: scopes may end during exit
  return *s;
}

int thread_id() {
  thread_local int id = -1;
  if (id < 0) {
    Store& s = store();
    std::lock_guard lk(s.mu);
    id = s.next_tid++;
  }
  return id;
}

}  // namespace

void set_enabled(bool on) { detail::g_enabled.store(on, std::memory_order_relaxed); }

double now_us() {
  Store& s = store();
  return std::chrono::duration<double, std::micro>(Clock::now() - s.origin).count();
}

void reset_origin() {
  Store& s = store();
  std::lock_guard lk(s.mu);
  s.origin = Clock::now();
}

std::vector<Event> take() {
  Store& s = store();
  std::lock_guard lk(s.mu);
  return std::exchange(s.events, {});
}

void record(Event e) {
  e.tid = thread_id();
  Store& s = store();
  std::lock_guard lk(s.mu);
  s.events.push_back(std::move(e));
}

std::string shapes_of(const std::vector<Tensor>& tensors) {
  std::ostringstream out;
  bool first = true;
  for (const Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (!first) out << ' ';
    first = false;
    out << '(';
    const Shape& sh = t.shape();
    for (size_t i = 0; i < sh.size(); ++i) out << (i ? ", " : "") << sh[i];
    out << ')';
  }
  return out.str();
}

void Scope::begin(const char* cat, std::string name) {
  active_ = true;
  event_.cat = cat;
  event_.name = std::move(name);
  event_.ts_us = now_us();
}

void Scope::end() {
  if (!active_) return;
  active_ = false;
  event_.dur_us = now_us() - event_.ts_us;
  record(std::move(event_));
}

}  // namespace quilt::trace
