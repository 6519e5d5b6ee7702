// Collective observers: a per-thread callback that sees every operation a Communicator issues
// on that thread (op, sequence number, communicator, dtype, shape, bytes, async or not), in
// issue order. Tests count and order collectives with it (one all-gather per FSDP unit, say),
// and it may hold one back for a while (a fault injection that shows what overlaps a slow
// collective). The threads backend runs each rank on its own thread, so each rank can observe
// its own. Costs one load of a process-wide count per operation while no thread has an observer.
//
//   std::vector<CollectiveRecord> seen;
//   ScopedCollectiveObserver obs([&](const CollectiveRecord& r) { seen.push_back(r); return kNoDelay; });
//   comm.all_gather(out, in);            // seen[0].op == "all_gather", seen[0].bytes == in's bytes
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "engine/tensor.h"

namespace quilt {

/// One operation as it was issued.
struct CollectiveRecord {
  std::string op;    // "all_gather", "reduce_scatter", "all_reduce", "send", ...
  uint64_t seq = 0;  // the communicator's sequence number (collectives) or p2p counter
  std::string comm;  // communicator name
  int comm_size = 1;
  DType dtype = DType::f32;
  Shape shape;        // the op's main tensor: t, in (gathers, all-to-all) or out (scatters)
  int64_t bytes = 0;  // bytes of that tensor
  bool async = false;
};

/// No delay: the operation runs as soon as it can.
inline constexpr std::chrono::milliseconds kNoDelay{0};

/// Called at issue; the returned delay holds the operation back that long before it runs (on
/// the backend's worker when asynchronous, so the caller goes on meanwhile).
using CollectiveObserver = std::function<std::chrono::milliseconds(const CollectiveRecord&)>;

/// Installs `observer` for operations issued on this thread until destruction (nests: the
/// previous observer comes back).
class ScopedCollectiveObserver {
 public:
  explicit ScopedCollectiveObserver(CollectiveObserver observer);
  ~ScopedCollectiveObserver();
  ScopedCollectiveObserver(const ScopedCollectiveObserver&) = delete;
  ScopedCollectiveObserver& operator=(const ScopedCollectiveObserver&) = delete;

 private:
  CollectiveObserver observer_;
  const CollectiveObserver* previous_;
};

namespace detail {
/// The observer installed on this thread, or null.
const CollectiveObserver* current_collective_observer();
}  // namespace detail

}  // namespace quilt
