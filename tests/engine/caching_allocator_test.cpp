// The caching pool behind the CUDA allocator, on a fake device: rounding, segments, reuse on
// the same stream, cross-stream reuse gated by free-time events, splitting, merging,
// empty_cache, the out-of-memory retry, the counters, record_stream and graph-capture pools.
// Runs in every build.
#include <doctest/doctest.h>

#include <map>
#include <set>
#include <vector>

#include "engine/caching_pool.h"
#include "engine/error.h"

using namespace quilt;

namespace {

constexpr size_t kMiB = size_t(1) << 20;

// A device with `capacity` bytes at made-up addresses, and events that complete only when
// the test says their stream has finished.
class FakeDevice final : public PoolBackend {
 public:
  explicit FakeDevice(size_t capacity) : capacity_(capacity) {}
  ~FakeDevice() override {
    for (auto& [ev, state] : events_) delete static_cast<int*>(ev);
  }

  void* malloc(size_t bytes) override {
    ++malloc_calls;  // cudaMalloc is legal during a capture
    if (used_ + bytes > capacity_) return nullptr;
    used_ += bytes;
    char* p = reinterpret_cast<char*>(next_);
    next_ += bytes + 4096;  // gaps: neighbouring segments must never look contiguous
    live_[p] = bytes;
    return p;
  }
  void free(void* ptr) override {
    REQUIRE_MESSAGE(!capturing, "cudaFree during a graph capture");
    auto it = live_.find(static_cast<char*>(ptr));
    REQUIRE_MESSAGE(it != live_.end(), "pool freed memory the fake device never handed out");
    used_ -= it->second;
    live_.erase(it);
    ++free_calls;
  }
  void* event_create() override {
    void* ev = new int(0);
    events_[ev] = {nullptr, true};
    ++events_created;
    return ev;
  }
  void event_destroy(void* ev) override {
    events_.erase(ev);
    delete static_cast<int*>(ev);
  }
  void event_record(void* ev, void* stream) override {
    REQUIRE_MESSAGE(!capturing, "an event recorded into a graph capture");
    events_[ev] = {stream, false};
  }
  bool event_query(void* ev) override {
    REQUIRE_MESSAGE(!capturing, "cudaEventQuery during a graph capture");
    return events_[ev].done;
  }
  void event_synchronize(void* ev) override {
    REQUIRE_MESSAGE(!capturing, "cudaEventSynchronize during a graph capture");
    events_[ev].done = true;
    ++syncs;
  }

  /// Everything queued on `stream` so far has run.
  void finish(void* stream) {
    for (auto& [ev, state] : events_)
      if (state.stream == stream) state.done = true;
  }
  size_t used() const { return used_; }
  size_t live_segments() const { return live_.size(); }

  int malloc_calls = 0, free_calls = 0, events_created = 0, syncs = 0;
  bool capturing = false;  // set by the test around a capture: the calls CUDA forbids then fail it

 private:
  struct EventState {
    void* stream;
    bool done;
  };
  size_t capacity_, used_ = 0;
  uintptr_t next_ = 0x10000000;
  std::map<char*, size_t> live_;
  std::map<void*, EventState> events_;
};

void* const kStreamA = reinterpret_cast<void*>(0xA);
void* const kStreamB = reinterpret_cast<void*>(0xB);
void* const kStreamC = reinterpret_cast<void*>(0xC);

}  // namespace

TEST_CASE("caching pool: small requests round to 512 B and share one 2 MiB segment") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  CHECK(CachingPool::round_size(1) == 512);
  CHECK(CachingPool::round_size(512) == 512);
  CHECK(CachingPool::round_size(1000) == 1024);
  void* a = pool.allocate(1000, kStreamA);
  void* b = pool.allocate(1, kStreamA);
  void* c = pool.allocate(3000, kStreamA);
  CHECK(static_cast<char*>(b) - static_cast<char*>(a) == 1024);
  CHECK(static_cast<char*>(c) - static_cast<char*>(b) == 512);
  const MemoryStats s = pool.stats();
  CHECK(s.allocated == 1024 + 512 + 3072);
  CHECK(s.reserved == int64_t(2 * kMiB));
  CHECK(s.num_allocs == 3);
  CHECK(s.num_system_allocs == 1);
  CHECK(dev.malloc_calls == 1);
  CHECK(pool.allocate(0, kStreamA) == nullptr);
  pool.deallocate(nullptr);  // ignored
  CHECK(pool.stats().num_allocs == 3);
}

TEST_CASE("caching pool: a freed block is reused on the same stream without a system allocation") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* big = pool.allocate(3 * kMiB, kStreamA);  // large pool: a 4 MiB segment
  CHECK(pool.stats().reserved == int64_t(4 * kMiB));
  pool.deallocate(big);
  CHECK(pool.stats().allocated == 0);
  CHECK(pool.cached_bytes() == 4 * kMiB);
  void* again = pool.allocate(3 * kMiB - 100, kStreamA);
  CHECK(again == big);
  CHECK(pool.stats().num_system_allocs == 1);
  CHECK(dev.malloc_calls == 1);
}

TEST_CASE("caching pool: another stream waits for the free-time event before reusing a block") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(5 * kMiB, kStreamA);
  pool.deallocate(a);  // stream A's kernels may still use it
  void* b = pool.allocate(5 * kMiB, kStreamB);
  CHECK(b != a);  // not reusable yet: a new segment
  CHECK(pool.stats().num_system_allocs == 2);
  dev.finish(kStreamA);  // A's event has completed
  void* c = pool.allocate(5 * kMiB, kStreamB);
  CHECK(c == a);
  CHECK(pool.stats().num_system_allocs == 2);
  // b goes back to the cache for stream B, which has not finished: stream A cannot take it yet.
  pool.deallocate(b);
  void* d = pool.allocate(5 * kMiB, kStreamA);
  CHECK(d != b);
  CHECK(pool.stats().num_system_allocs == 3);
  pool.deallocate(c);
  pool.deallocate(d);
}

TEST_CASE("caching pool: a large cached block is split and the remainder serves the next request") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(9 * kMiB, kStreamA);  // 10 MiB segment
  pool.deallocate(a);
  void* b = pool.allocate(3 * kMiB, kStreamA);
  CHECK(b == a);
  void* c = pool.allocate(6 * kMiB, kStreamA);  // from the 7 MiB remainder
  CHECK(static_cast<char*>(c) == static_cast<char*>(a) + 3 * kMiB);
  CHECK(pool.stats().num_system_allocs == 1);
  CHECK(pool.stats().allocated == int64_t(3 * kMiB + 7 * kMiB));  // the last 1 MiB was not worth a split
  // Freeing both merges the segment back into one block: a 10 MiB request fits again.
  pool.deallocate(b);
  pool.deallocate(c);
  void* d = pool.allocate(10 * kMiB, kStreamA);
  CHECK(d == a);
  CHECK(pool.stats().num_system_allocs == 1);
}

TEST_CASE("caching pool: the remainder of a split keeps the free-time event for other streams") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(8 * kMiB, kStreamA);
  pool.deallocate(a);                            // event pending on A
  void* b = pool.allocate(2 * kMiB, kStreamA);   // same stream: fine at once; 6 MiB remainder stays cached
  CHECK(b == a);
  void* c = pool.allocate(4 * kMiB, kStreamB);   // the remainder may still be in use by A's earlier work
  CHECK(static_cast<char*>(c) != static_cast<char*>(a) + 2 * kMiB);
  CHECK(pool.stats().num_system_allocs == 2);
  dev.finish(kStreamA);
  void* d = pool.allocate(4 * kMiB, kStreamB);
  CHECK(static_cast<char*>(d) == static_cast<char*>(a) + 2 * kMiB);
}

TEST_CASE("caching pool: neighbouring small blocks merge when freed") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(512, kStreamA);
  void* b = pool.allocate(512, kStreamA);
  void* c = pool.allocate(512, kStreamA);
  void* keep = pool.allocate(512, kStreamA);
  pool.deallocate(b);
  pool.deallocate(a);
  pool.deallocate(c);
  void* abc = pool.allocate(1536, kStreamA);
  CHECK(abc == a);
  CHECK(pool.stats().num_system_allocs == 1);
  pool.deallocate(abc);
  pool.deallocate(keep);
  CHECK(pool.stats().allocated == 0);
}

TEST_CASE("caching pool: empty_cache returns only fully free segments to the device") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* small = pool.allocate(4096, kStreamA);
  void* large = pool.allocate(3 * kMiB, kStreamA);
  void* other = pool.allocate(5 * kMiB, kStreamA);
  pool.deallocate(large);
  pool.deallocate(other);
  CHECK(pool.segment_count() == 3);
  const int syncs_before = dev.syncs;
  pool.empty_cache();
  CHECK(dev.syncs - syncs_before == 2);  // waits for each freed segment's event before freeing it
  CHECK(pool.segment_count() == 1);      // the small segment is still in use
  CHECK(dev.live_segments() == 1);
  CHECK(pool.stats().reserved == int64_t(2 * kMiB));
  CHECK(pool.stats().allocated == 4096);
  pool.deallocate(small);
  pool.empty_cache();
  CHECK(pool.segment_count() == 0);
  CHECK(dev.used() == 0);
  CHECK(pool.stats().reserved == 0);
}

TEST_CASE("caching pool: empty_cache returns a segment whose free blocks belong to different streams") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(4096, kStreamA);
  void* b = pool.allocate(4096, kStreamB);  // the untouched rest of A's segment moves to stream B
  CHECK(static_cast<char*>(b) == static_cast<char*>(a) + 4096);
  CHECK(pool.segment_count() == 1);
  pool.deallocate(a);
  pool.deallocate(b);  // two free blocks of two streams: they do not merge
  pool.empty_cache();
  CHECK(pool.segment_count() == 0);
  CHECK(dev.used() == 0);
}

TEST_CASE("caching pool: out of memory empties the cache, retries once, then names the size") {
  FakeDevice dev(8 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* small = pool.allocate(1000, kStreamA);  // 2 MiB small segment
  pool.deallocate(small);
  // 8 MiB does not fit next to the cached 2 MiB: the pool frees its cache and retries.
  void* big = pool.allocate(7 * kMiB, kStreamA);
  CHECK(big != nullptr);
  CHECK(dev.free_calls == 1);
  CHECK(pool.stats().reserved == int64_t(8 * kMiB));
  // Now nothing is cached and the device is full: the error names the request and the counters.
  CHECK_THROWS_WITH_AS(pool.allocate(3 * kMiB, kStreamA),
                       doctest::Contains("[cuda allocator] out of memory on fake:0 allocating 3.00 MiB (3145728 bytes"),
                       Error);
  try {
    pool.allocate(3 * kMiB, kStreamA);
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("allocated 8.00 MiB, reserved 8.00 MiB") != std::string::npos);
  }
  pool.deallocate(big);
  CHECK(pool.allocate(3 * kMiB, kStreamA) == big);  // the cached block serves it after all
}

TEST_CASE("caching pool: peak tracks the high-water mark until reset") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(4 * kMiB, kStreamA);
  void* b = pool.allocate(2 * kMiB + 1, kStreamA);
  const int64_t both = int64_t(4 * kMiB) + int64_t(CachingPool::round_size(2 * kMiB + 1));
  CHECK(pool.stats().peak_allocated == both);
  pool.deallocate(b);
  CHECK(pool.stats().allocated == int64_t(4 * kMiB));
  CHECK(pool.stats().peak_allocated == both);
  pool.reset_peak();
  CHECK(pool.stats().peak_allocated == int64_t(4 * kMiB));
  pool.deallocate(a);
}

TEST_CASE("caching pool: freeing a pointer it did not hand out is an error naming the pool") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  int x = 0;
  CHECK_THROWS_WITH_AS(pool.deallocate(&x), doctest::Contains("[cuda allocator] fake:0: free of pointer"), Error);
  void* a = pool.allocate(100, kStreamA);
  pool.deallocate(a);
  CHECK_THROWS_WITH_AS(pool.deallocate(a), doctest::Contains("freed twice"), Error);
}

TEST_CASE("caching pool: events are recycled rather than created per free") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  for (int i = 0; i < 100; ++i) {
    void* p = pool.allocate(4096, kStreamA);
    pool.deallocate(p);
  }
  CHECK(dev.events_created <= 2);
  CHECK(pool.stats().num_system_allocs == 1);
  CHECK(pool.stats().num_allocs == 100);
}

TEST_CASE("caching pool: random allocations on two streams never overlap and the counters add up") {
  FakeDevice dev(size_t(1) << 40);
  CachingPool pool(dev, "fake:0");
  std::map<char*, size_t> live;  // address -> requested bytes
  uint64_t state = 12345;
  auto next = [&] { state = state * 6364136223846793005ull + 1442695040888963407ull; return state >> 33; };
  for (int step = 0; step < 20000; ++step) {
    const uint64_t r = next();
    if (live.size() < 200 && (r % 3 != 0 || live.empty())) {
      // Sizes from a few bytes to ~12 MiB, mostly small.
      const size_t bytes = r % 7 == 0 ? size_t(next() % (12 * kMiB)) + 1 : size_t(next() % 70000) + 1;
      void* const stream = (r >> 8) % 2 ? kStreamA : kStreamB;
      char* p = static_cast<char*>(pool.allocate(bytes, stream));
      auto after = live.lower_bound(p);
      if (after != live.end()) REQUIRE(p + bytes <= after->first);
      if (after != live.begin()) {
        auto before = std::prev(after);
        REQUIRE(before->first + before->second <= p);
      }
      live[p] = bytes;
      if (next() % 11 == 0) pool.record_stream(p, stream == kStreamA ? kStreamB : kStreamA);
    } else {
      auto it = live.begin();
      std::advance(it, long(next() % live.size()));
      pool.deallocate(it->first);
      live.erase(it);
    }
    if (r % 17 == 0) dev.finish(kStreamA);
    if (r % 19 == 0) dev.finish(kStreamB);
    if (r % 997 == 0) pool.empty_cache();
    const MemoryStats s = pool.stats();
    REQUIRE(s.reserved == int64_t(dev.used()));
    REQUIRE(s.allocated <= s.reserved);
  }
  size_t requested = 0;
  for (auto& [p, n] : live) requested += CachingPool::round_size(n);
  CHECK(pool.stats().allocated >= int64_t(requested));
  CHECK(pool.stats().num_system_allocs < pool.stats().num_allocs / 4);  // the cache does its job
  for (auto& [p, n] : live) pool.deallocate(p);
  CHECK(pool.stats().allocated == 0);
  pool.empty_cache();
  CHECK(pool.stats().reserved == 0);
  CHECK(dev.used() == 0);
}

TEST_CASE("caching pool: a block recorded on another stream waits for that stream, even on its own") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(5 * kMiB, kStreamA);
  pool.record_stream(a, kStreamB);  // a collective on B reads it
  pool.record_stream(a, kStreamB);  // recorded once
  pool.record_stream(a, kStreamA);  // its own stream: nothing to do
  pool.deallocate(a);
  CHECK(pool.held_count() == 1);
  void* b = pool.allocate(5 * kMiB, kStreamA);  // B may still read a: not even A may take it
  CHECK(b != a);
  dev.finish(kStreamA);
  void* c = pool.allocate(5 * kMiB, kStreamA);
  CHECK(c != a);
  CHECK(pool.held_count() == 1);
  dev.finish(kStreamB);
  void* d = pool.allocate(5 * kMiB, kStreamA);
  CHECK(d == a);
  CHECK(pool.held_count() == 0);
  CHECK(pool.stats().num_system_allocs == 3);
  // A block with no other stream recorded goes back to its stream at once, as before.
  pool.deallocate(d);
  CHECK(pool.held_count() == 0);
  CHECK(pool.allocate(5 * kMiB, kStreamA) == a);
  CHECK_THROWS_WITH_AS(pool.record_stream(reinterpret_cast<void*>(0x1234), kStreamB),
                       doctest::Contains("[cuda allocator] fake:0: record_stream on pointer"), Error);
  pool.deallocate(b);
  pool.deallocate(c);
}

TEST_CASE("caching pool: a held block does not merge with its neighbours until it is released") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(512, kStreamA);
  void* b = pool.allocate(512, kStreamA);
  void* keep = pool.allocate(512, kStreamA);
  pool.record_stream(b, kStreamB);
  pool.deallocate(b);
  pool.deallocate(a);
  void* ab = pool.allocate(1024, kStreamA);  // a alone is 512 B: b is held, so no 1 KiB run here
  CHECK(ab != a);
  dev.finish(kStreamB);
  pool.deallocate(ab);
  void* again = pool.allocate(1024, kStreamA);  // b released and merged with a
  CHECK(again == a);
  pool.empty_cache();
  CHECK(pool.segment_count() == 1);
  pool.deallocate(again);
  pool.deallocate(keep);
  pool.empty_cache();
  CHECK(pool.segment_count() == 0);
  CHECK(dev.used() == 0);
}

TEST_CASE("caching pool: empty_cache waits for held blocks and returns their segments") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(3 * kMiB, kStreamA);
  pool.record_stream(a, kStreamB);
  pool.deallocate(a);
  pool.empty_cache();
  CHECK(pool.held_count() == 0);
  CHECK(pool.segment_count() == 0);
  CHECK(dev.used() == 0);
}

TEST_CASE("caching pool: a capture allocates from a private pool and queries no event") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* cached = pool.allocate(3 * kMiB, kStreamA);
  void* before = pool.allocate(4096, kStreamA);  // allocated before the capture, freed during it
  pool.deallocate(cached);
  dev.finish(kStreamA);
  const int id = pool.begin_capture(kStreamA);
  CHECK(id == 1);
  CHECK(pool.capture_underway());
  dev.capturing = true;
  void* x = pool.allocate(3 * kMiB, kStreamA);  // the cached general block is not the graph's
  CHECK(x != cached);
  pool.deallocate(x);                            // reused within the capture, in stream order
  void* y = pool.allocate(3 * kMiB, kStreamA);
  CHECK(y == x);
  void* other = pool.allocate(3 * kMiB, kStreamB);  // not capturing: the general pool, but no event query
  CHECK(other != cached);
  pool.deallocate(before);  // its free event would land in the capture: deferred
  pool.deallocate(other);
  CHECK(pool.held_count() == 2);
  dev.capturing = false;
  pool.end_capture(kStreamA);
  CHECK(!pool.capture_underway());
  CHECK(pool.held_count() == 0);
  CHECK(pool.allocate(4096, kStreamA) == before);
  // Outside the capture the graph's memory stays the graph's: y's block is live, and a
  // general request does not get the private pool's free remainder.
  void* z = pool.allocate(3 * kMiB, kStreamA);
  CHECK(z == cached);
  CHECK_THROWS_WITH_AS(pool.end_capture(kStreamA), doctest::Contains("that is not capturing"), Error);
  pool.deallocate(y);
  pool.deallocate(z);
}

TEST_CASE("caching pool: a later capture may share a private pool, and release_pool hands it back") {
  FakeDevice dev(64 * kMiB);
  CachingPool pool(dev, "fake:0");
  const int id = pool.begin_capture(kStreamA);
  dev.capturing = true;
  void* x = pool.allocate(3 * kMiB, kStreamA);
  void* kept = pool.allocate(3 * kMiB, kStreamA);  // a graph output the caller keeps
  pool.deallocate(x);
  dev.capturing = false;
  pool.end_capture(kStreamA);
  CHECK(pool.begin_capture(kStreamB, id) == id);
  dev.capturing = true;
  CHECK_THROWS_WITH_AS(pool.begin_capture(kStreamB), doctest::Contains("already capturing"), Error);
  CHECK_THROWS_WITH_AS(pool.release_pool(id, kStreamA), doctest::Contains("still captures into it"), Error);
  CHECK_THROWS_WITH_AS(pool.empty_cache(), doctest::Contains("during a graph capture"), Error);
  dev.capturing = false;
  pool.end_capture(kStreamB);
  CHECK(pool.allocate(3 * kMiB, kStreamA) != x);  // private until released
  pool.release_pool(id, kStreamC);                  // the graph's last replay ran on C
  void* on_a = pool.allocate(3 * kMiB, kStreamA);
  CHECK(on_a != x);  // C's replay may still write x: not even the capture stream may take it
  void* on_b = pool.allocate(3 * kMiB, kStreamB);
  CHECK(on_b != x);
  dev.finish(kStreamC);
  void* on_b2 = pool.allocate(3 * kMiB, kStreamB);
  CHECK(on_b2 == x);
  pool.deallocate(kept);  // a live block of the released pool joins the general cache when freed
  CHECK(pool.allocate(3 * kMiB, kStreamA) == kept);
  CHECK_THROWS_WITH_AS(pool.begin_capture(kStreamA, 7), doctest::Contains("no private pool 7"), Error);
  CHECK_THROWS_WITH_AS(pool.release_pool(0, kStreamA), doctest::Contains("the general pool"), Error);
}

TEST_CASE("caching pool: out of memory during a capture fails without returning the cache") {
  FakeDevice dev(8 * kMiB);
  CachingPool pool(dev, "fake:0");
  void* a = pool.allocate(5 * kMiB, kStreamA);
  pool.deallocate(a);  // 6 MiB cached
  pool.begin_capture(kStreamA);
  dev.capturing = true;
  CHECK_THROWS_WITH_AS(pool.allocate(5 * kMiB, kStreamA),
                       doctest::Contains("during a graph capture, when cached blocks cannot go back"), Error);
  CHECK(dev.free_calls == 0);
  dev.capturing = false;
  pool.end_capture(kStreamA);
  CHECK(pool.allocate(5 * kMiB, kStreamA) == a);
}
