// The caching pool's bookkeeping (see engine/caching_pool.h). Every method holds the mutex;
// the backend is only called with it held, so the pool never races with itself.
#include "engine/caching_pool.h"

#include <algorithm>
#include <cstdio>
#include <functional>

#include "engine/error.h"

namespace quilt {

// A run of bytes inside one segment. Blocks of a segment form a doubly linked list in
// address order, so a freed block can merge with free neighbours.
struct CachingPool::Block {
  char* ptr = nullptr;
  size_t size = 0;
  void* stream = nullptr;  // the stream that may use it without waiting
  int pool = 0;            // 0: the general pool; otherwise a graph's private pool
  bool small = false;
  bool allocated = false;
  bool held = false;       // freed but not yet reusable (in held_ or deferred_)
  std::vector<void*> uses;  // other streams that used it (record_stream)
  Block* prev = nullptr;
  Block* next = nullptr;
  // Recorded on `stream` when the block was freed: another stream may take the block only
  // after all of them completed (the freeing stream's kernels may still read or write it).
  std::vector<StreamEvent> events;
};

bool CachingPool::BySize::operator()(const Block* a, const Block* b) const {
  if (a->pool != b->pool) return a->pool < b->pool;
  if (a->stream != b->stream) return std::less<void*>()(a->stream, b->stream);
  if (a->size != b->size) return a->size < b->size;
  return std::less<char*>()(a->ptr, b->ptr);
}

namespace {

std::string human(int64_t bytes) {
  char buf[32];
  const double b = double(bytes);
  if (b >= double(1ull << 30)) std::snprintf(buf, sizeof(buf), "%.2f GiB", b / double(1ull << 30));
  else if (b >= double(1ull << 20)) std::snprintf(buf, sizeof(buf), "%.2f MiB", b / double(1ull << 20));
  else if (b >= 1024.0) std::snprintf(buf, sizeof(buf), "%.2f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  return buf;
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

}  // namespace

CachingPool::CachingPool(PoolBackend& backend, std::string name) : backend_(backend), name_(std::move(name)) {}

CachingPool::~CachingPool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (FreeSet* set : {&small_free_, &large_free_}) {
    for (Block* b : *set) delete b;
    set->clear();
  }
  for (auto& [ptr, b] : live_) delete b;
  live_.clear();
  for (Held& h : held_) delete h.block;
  held_.clear();
  for (Block* b : deferred_) delete b;
  deferred_.clear();
  for (auto& [base, bytes] : segments_) backend_.free(base);
  segments_.clear();
  for (void* ev : free_events_) backend_.event_destroy(ev);
  free_events_.clear();
}

size_t CachingPool::round_size(size_t bytes) { return bytes == 0 ? kRound : round_up(bytes, kRound); }

void* CachingPool::allocate(size_t bytes, void* stream) {
  if (bytes == 0) return nullptr;
  const size_t size = round_size(bytes);
  const bool small = size <= kSmallLimit;
  std::lock_guard<std::mutex> lock(mu_);
  const auto cap = captures_.find(stream);
  const int pool = cap == captures_.end() ? 0 : cap->second;
  const bool capturing = !captures_.empty();  // then no event may be queried
  if (!capturing) process_held();
  FreeSet& set = small ? small_free_ : large_free_;
  Block* b = find_free(set, size, stream, pool);
  if (!b && !capturing) b = find_free_other_stream(set, size, stream, pool);
  if (b) {
    set.erase(b);
    b->stream = stream;
  } else {
    b = new_segment(size, small, stream, bytes, pool);
  }
  Block* rest = split(b, size);
  if (rest) set.insert(rest);
  b->events.clear();  // after split(): the remainder keeps the free-time events it still needs
  b->uses.clear();
  b->allocated = true;
  live_[b->ptr] = b;
  stats_.allocated += int64_t(b->size);
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  ++stats_.num_allocs;
  return b->ptr;
}

void CachingPool::deallocate(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  QUILT_CHECK(it != live_.end(), "[cuda allocator] ", name_, ": free of pointer ", ptr,
              " that this allocator did not hand out (or freed twice)");
  Block* b = it->second;
  live_.erase(it);
  b->allocated = false;
  stats_.allocated -= int64_t(b->size);
  if (!captures_.empty()) {
    // A private block freed on the stream capturing into its pool needs no event: the graph
    // replays in stream order, and only that capture allocates from the pool. Anything else
    // would record an event into the capture: it waits until no capture runs.
    const auto cap = captures_.find(b->stream);
    if (b->pool != 0 && cap != captures_.end() && cap->second == b->pool && b->uses.empty()) {
      merge_free(b, false);
    } else {
      b->held = true;
      deferred_.push_back(b);
    }
    return;
  }
  free_block(b);
}

void CachingPool::record_stream(void* ptr, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  QUILT_CHECK(it != live_.end(), "[cuda allocator] ", name_, ": record_stream on pointer ", ptr,
              " that is not a live block of this allocator");
  Block* b = it->second;
  if (stream == b->stream) return;
  if (std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) b->uses.push_back(stream);
}

int CachingPool::begin_capture(void* stream, int pool) {
  std::lock_guard<std::mutex> lock(mu_);
  QUILT_CHECK(!captures_.count(stream), "[cuda allocator] ", name_, ": stream ", stream,
              " is already capturing a graph");
  QUILT_CHECK(pool >= 0 && pool < next_pool_, "[cuda allocator] ", name_, ": no private pool ", pool,
              " (pools so far: 1..", next_pool_ - 1, ")");
  if (pool == 0) pool = next_pool_++;
  captures_[stream] = pool;
  return pool;
}

void CachingPool::end_capture(void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  QUILT_CHECK(captures_.erase(stream) == 1, "[cuda allocator] ", name_, ": end_capture on stream ", stream,
              " that is not capturing");
  if (!captures_.empty()) return;
  std::vector<Block*> deferred = std::move(deferred_);
  deferred_.clear();
  for (Block* b : deferred) {
    b->held = false;
    free_block(b);
  }
}

void CachingPool::release_pool(int pool, void* replay_stream) {
  std::lock_guard<std::mutex> lock(mu_);
  QUILT_CHECK(pool > 0, "[cuda allocator] ", name_, ": release_pool(", pool, "): the general pool is not a graph's");
  for (auto& [stream, p] : captures_)
    QUILT_CHECK(p != pool, "[cuda allocator] ", name_, ": release_pool(", pool, ") while stream ", stream,
                " still captures into it");
  // Take the pool's free blocks out of the sets (their order depends on the pool), re-tag every
  // block of the pool, and put the free ones back as blocks of the replay stream: the replay
  // may still write them, so that stream may reuse them at once and every other one (the
  // capture stream too) only after the replay's event.
  std::vector<Block*> free_blocks;
  for (FreeSet* set : {&small_free_, &large_free_})
    for (auto it = set->begin(); it != set->end();)
      if ((*it)->pool == pool) {
        free_blocks.push_back(*it);
        it = set->erase(it);
      } else {
        ++it;
      }
  for (auto& [ptr, b] : live_)
    if (b->pool == pool) b->pool = 0;
  for (Held& h : held_)
    if (h.block->pool == pool) h.block->pool = 0;
  for (Block* b : deferred_)
    if (b->pool == pool) b->pool = 0;
  if (free_blocks.empty()) return;
  const StreamEvent replayed{record_event(replay_stream), replay_stream};
  for (Block* b : free_blocks) {
    b->pool = 0;
    b->stream = replay_stream;
    b->events.push_back(replayed);
    (b->small ? small_free_ : large_free_).insert(b);
  }
}

bool CachingPool::capture_underway() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !captures_.empty();
}

size_t CachingPool::held_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_.size() + deferred_.size();
}

// The free of `b` outside a capture: an event on its stream gates other streams; the streams
// that also used it hold it back from every stream until their events complete.
void CachingPool::free_block(Block* b) {
  b->events.push_back({record_event(b->stream), b->stream});
  if (b->uses.empty()) {
    merge_free(b, true);
    return;
  }
  Held h{b, {}};
  for (void* s : b->uses) h.events.push_back({record_event(s), s});
  b->uses.clear();
  b->held = true;
  held_.push_back(std::move(h));
}

// Held blocks whose other streams have finished with them enter the cache.
void CachingPool::process_held() {
  for (size_t i = 0; i < held_.size();) {
    if (events_done(held_[i].events)) {
      Block* b = held_[i].block;
      held_[i] = std::move(held_.back());
      held_.pop_back();
      b->held = false;
      b->events.push_back({record_event(b->stream), b->stream});  // now the last of its stream
      merge_free(b, true);
    } else {
      ++i;
    }
  }
}

void CachingPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  QUILT_CHECK(captures_.empty(), "[cuda allocator] ", name_,
              ": empty_cache() during a graph capture (memory cannot go back to the device while one runs)");
  for (Held& h : held_)
    for (const StreamEvent& e : h.events) backend_.event_synchronize(e.event.get());
  process_held();
  release_cached();
}

MemoryStats CachingPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingPool::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_allocated = stats_.allocated;
}

size_t CachingPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_t(stats_.reserved - stats_.allocated);
}

size_t CachingPool::segment_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return segments_.size();
}

// Smallest free block of `stream` with at least `size` bytes.
CachingPool::Block* CachingPool::find_free(FreeSet& set, size_t size, void* stream, int pool) {
  Block key;
  key.pool = pool;
  key.stream = stream;
  key.size = size;
  auto it = set.lower_bound(&key);
  if (it == set.end() || (*it)->stream != stream || (*it)->pool != pool) return nullptr;
  return *it;
}

// Smallest free block of another stream whose free-time events have all completed.
CachingPool::Block* CachingPool::find_free_other_stream(FreeSet& set, size_t size, void* stream, int pool) {
  std::vector<Block*> fits;
  for (Block* b : set)
    if (b->pool == pool && b->stream != stream && b->size >= size) fits.push_back(b);
  std::sort(fits.begin(), fits.end(), [](const Block* a, const Block* b) {
    return a->size != b->size ? a->size < b->size : std::less<char*>()(a->ptr, b->ptr);
  });
  for (Block* b : fits)
    if (events_done(b->events)) return b;
  return nullptr;
}

bool CachingPool::events_done(std::vector<StreamEvent>& ev) {
  ev.erase(std::remove_if(ev.begin(), ev.end(),
                          [&](const StreamEvent& e) { return backend_.event_query(e.event.get()); }),
           ev.end());
  return ev.empty();
}

CachingPool::Block* CachingPool::new_segment(size_t size, bool small, void* stream, size_t request, int pool) {
  const size_t seg = small ? kSmallSegment : round_up(size, kLargeRound);
  void* p = backend_.malloc(seg);
  if (!p && !captures_.empty())
    fail("[cuda allocator] out of memory on ", name_, " allocating ", human(int64_t(request)), " (", request,
         " bytes, segment of ", seg, " bytes) during a graph capture, when cached blocks cannot go back to the "
         "device: ", describe());
  if (!p) {  // out of memory: give the cache back to the device and try once more
    release_cached();
    p = backend_.malloc(seg);
  }
  if (!p)
    fail("[cuda allocator] out of memory on ", name_, " allocating ", human(int64_t(request)), " (", request,
         " bytes, segment of ", seg, " bytes) after emptying the cache: ", describe());
  stats_.reserved += int64_t(seg);
  ++stats_.num_system_allocs;
  segments_[p] = seg;
  Block* b = new Block();
  b->ptr = static_cast<char*>(p);
  b->size = seg;
  b->stream = stream;
  b->small = small;
  b->pool = pool;
  return b;
}

// Cuts `b` to `size` bytes when the rest is worth keeping; returns the free remainder.
CachingPool::Block* CachingPool::split(Block* b, size_t size) {
  const size_t rest = b->size - size;
  if (b->small ? rest < kRound : rest <= kSmallLimit) return nullptr;
  Block* r = new Block();
  r->ptr = b->ptr + size;
  r->size = rest;
  r->stream = b->stream;
  r->small = b->small;
  r->pool = b->pool;
  r->events = b->events;
  r->prev = b;
  r->next = b->next;
  if (b->next) b->next->prev = r;
  b->next = r;
  b->size = size;
  return r;
}

// Inserts the freed block `b` into its free set, merged with free neighbours of its stream.
// `fresh`: b's last event was just recorded on its stream, so it covers the neighbours' events
// of that stream (recorded earlier); their events of other streams (a replay) are kept.
void CachingPool::merge_free(Block* b, bool fresh) {
  FreeSet& set = b->small ? small_free_ : large_free_;
  for (Block* n : {b->prev, b->next}) {
    if (!n || n->allocated || n->held || n->stream != b->stream) continue;
    set.erase(n);
    if (n == b->prev) {
      b->ptr = n->ptr;
      b->prev = n->prev;
      if (b->prev) b->prev->next = b;
    } else {
      b->next = n->next;
      if (b->next) b->next->prev = b;
    }
    b->size += n->size;
    for (StreamEvent& e : n->events)
      if (!fresh || e.stream != b->stream) b->events.push_back(std::move(e));
    delete n;
  }
  set.insert(b);
}

// Returns every segment whose blocks are all free (of any stream) to the backend, after
// waiting for the blocks' free-time events.
void CachingPool::release_cached() {
  std::vector<Block*> heads;
  for (FreeSet* set : {&small_free_, &large_free_})
    for (Block* b : *set)
      if (!b->prev) heads.push_back(b);
  for (Block* head : heads) {
    bool all_free = true;
    for (Block* b = head; b && all_free; b = b->next) all_free = !b->allocated && !b->held;
    if (!all_free) continue;
    FreeSet& set = head->small ? small_free_ : large_free_;
    char* const base = head->ptr;
    for (Block* b = head; b;) {
      for (const StreamEvent& e : b->events) backend_.event_synchronize(e.event.get());
      set.erase(b);
      Block* n = b->next;
      delete b;
      b = n;
    }
    backend_.free(base);
    stats_.reserved -= int64_t(segments_[base]);
    segments_.erase(base);
  }
}

CachingPool::EventRef CachingPool::record_event(void* stream) {
  void* ev = nullptr;
  if (free_events_.empty()) {
    ev = backend_.event_create();
  } else {
    ev = free_events_.back();
    free_events_.pop_back();
  }
  try {
    backend_.event_record(ev, stream);
  } catch (...) {
    free_events_.push_back(ev);
    throw;
  }
  // Runs with mu_ held: every place that drops a block's events holds it.
  return EventRef(ev, [this](void* e) { free_events_.push_back(e); });
}

std::string CachingPool::describe() const {
  return detail::concat("allocated ", human(stats_.allocated), ", reserved ", human(stats_.reserved), " (",
                        human(stats_.reserved - stats_.allocated), " cached), peak ", human(stats_.peak_allocated),
                        ", ", segments_.size(), " segments, ", stats_.num_allocs, " allocations");
}

}  // namespace quilt
