// Trace: timed slices of what a process does (ops with their shapes, collectives with bytes and
// mesh axis, FSDP gathers and reduce-scatters, data loading, the optimizer) for logging.trace,
// which writes them as Chrome/Perfetto trace events. Off unless set_enabled(true): a Scope then
// costs one relaxed atomic load, and nothing is built or stored.
//
//   trace::set_enabled(true);
//   {
//     trace::Scope s("op", "matmul");          // begins now (when enabled)
//     if (s.active()) s.arg("shapes", "(4, 8) (8, 2)");
//     ...                                       // ends at the end of the scope
//   }
//   std::vector<trace::Event> events = trace::take();
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "engine/tensor.h"

namespace quilt::trace {

/// An argument of an event: a number or a text.
using ArgValue = std::variant<int64_t, double, std::string>;

/// One finished slice: its category ("op", "collective", "fsdp", "data", "optimizer", ...),
/// name, start and duration in microseconds from the origin, and the recording thread.
struct Event {
  std::string cat;
  std::string name;
  double ts_us = 0;
  double dur_us = 0;
  int tid = 0;
  std::vector<std::pair<std::string, ArgValue>> args;
};

namespace detail {
extern std::atomic<bool> g_enabled;
}  // namespace detail

/// True while slices are recorded.
inline bool enabled() { return detail::g_enabled.load(std::memory_order_relaxed); }
/// Starts or stops recording (what was recorded stays until take()).
void set_enabled(bool on);
/// Microseconds since the origin (steady clock).
double now_us();
/// Makes now the origin of the timestamps of events recorded from here on (and of now_us()).
void reset_origin();
/// The events recorded so far, oldest first; the store is emptied.
std::vector<Event> take();
/// Records a finished slice (for spans timed elsewhere, with now_us() timestamps).
void record(Event e);
/// "(4, 8) (8, 2)": the shapes of the defined tensors, in order.
std::string shapes_of(const std::vector<Tensor>& tensors);

/// A slice from construction to destruction, recorded only when tracing was on at construction.
class Scope {
 public:
  Scope() = default;
  Scope(const char* cat, std::string name) {
    if (enabled()) begin(cat, std::move(name));
  }
  ~Scope() { end(); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  /// Begins the slice now (for scopes whose name is built only when tracing).
  void begin(const char* cat, std::string name);
  /// Ends and records the slice (once; the destructor does it otherwise).
  void end();
  bool active() const { return active_; }
  /// Adds an argument shown with the slice.
  void arg(const char* key, ArgValue value) {
    if (active_) event_.args.emplace_back(key, std::move(value));
  }

 private:
  bool active_ = false;
  Event event_;
};

}  // namespace quilt::trace
