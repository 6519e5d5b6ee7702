// The bookkeeping of the CUDA caching allocator, written against a small device interface
// (PoolBackend) so it builds without CUDA and is tested on the CPU with a fake device.
//
// Requests are rounded up to 512 B. Requests up to 1 MiB are carved from 2 MiB segments (the
// small pool); larger ones get segments rounded up to 2 MiB (the large pool), and a cached
// block bigger than needed is split. Freed blocks stay cached: the same stream reuses them at
// once (stream order makes that safe); another stream only after an event recorded at free
// time has completed. Neighbouring free blocks of one segment and stream merge again. When the
// device is out of memory the pool returns its cached segments and retries once.
//
// A block handed to another stream (record_stream) is reused, on any stream, only after the
// work queued on every stream that used it up to the free has completed. While a CUDA graph
// is captured, requests on the capturing stream come from a private pool that the graph keeps
// (its replays write the same addresses), and the pool queries no event and returns no memory
// to the device: both are illegal during a capture. Frees that would record an event then wait
// until the last capture ends.
//
//   CachingPool pool(backend, "cuda:0");
//   void* p = pool.allocate(1000, stream);   // a 1024 B block of a new 2 MiB segment
//   pool.deallocate(p);                       // cached: the next small request on `stream` reuses it
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/storage.h"

namespace quilt {

/// What the pool needs from a device. Streams and events are opaque handles.
class PoolBackend {
 public:
  virtual ~PoolBackend() = default;
  /// `bytes` of device memory, or nullptr when the device is out of memory (other errors throw).
  virtual void* malloc(size_t bytes) = 0;
  /// Returns memory from malloc() to the device.
  virtual void free(void* ptr) = 0;
  /// A new event (recorded later, possibly many times).
  virtual void* event_create() = 0;
  virtual void event_destroy(void* event) = 0;
  /// Marks the current end of `stream` in `event`.
  virtual void event_record(void* event, void* stream) = 0;
  /// True once the work recorded in `event` has completed.
  virtual bool event_query(void* event) = 0;
  /// Blocks until the work recorded in `event` has completed.
  virtual void event_synchronize(void* event) = 0;
};

/// A stream-aware caching pool of one device's memory. Thread-safe.
class CachingPool {
 public:
  static constexpr size_t kRound = 512;                // every block is a multiple of this
  static constexpr size_t kSmallLimit = size_t(1) << 20;   // requests up to this use the small pool
  static constexpr size_t kSmallSegment = size_t(2) << 20;  // small blocks are carved from these
  static constexpr size_t kLargeRound = size_t(2) << 20;    // large segments are multiples of this

  /// `name` ("cuda:0") appears in error messages.
  CachingPool(PoolBackend& backend, std::string name);
  /// Returns every segment to the backend (blocks still allocated are released too).
  ~CachingPool();
  CachingPool(const CachingPool&) = delete;
  CachingPool& operator=(const CachingPool&) = delete;

  /// A block of at least `bytes` for use on `stream`; nullptr for 0 bytes. Throws quilt::Error
  /// naming the size and the pool's counters when the device is out of memory.
  void* allocate(size_t bytes, void* stream);
  /// Returns a block from allocate() to the cache (nullptr is ignored).
  void deallocate(void* ptr);
  /// Marks the live block at `ptr` as used on `stream` too (a collective on the communication
  /// stream reading a tensor of the compute stream): once freed, it is reused only after the
  /// work queued on `stream` up to the free has completed. The block's own stream is ignored.
  void record_stream(void* ptr, void* stream);

  /// Starts a graph capture on `stream`: until end_capture(stream), its requests come from the
  /// private pool `pool` (a new one when 0). Returns the pool's id, which a later capture may
  /// pass to share the pool. Throws when `stream` is already capturing.
  int begin_capture(void* stream, int pool = 0);
  /// Ends the capture on `stream`; when it was the last one, the frees deferred during captures
  /// record their events and enter the cache.
  void end_capture(void* stream);
  /// The graph of private pool `pool` is gone; its last replay ran on `replay_stream`. Its blocks
  /// join the general pool: the free ones at once (other streams after that replay), the live
  /// ones when freed. Throws while a capture uses the pool.
  void release_pool(int pool, void* replay_stream);
  /// True while any capture runs on this pool.
  bool capture_underway() const;
  /// Freed blocks not yet reusable: waiting for another stream's events, or for a capture to end.
  size_t held_count() const;
  /// Returns every fully free segment to the backend (waiting for their free-time events).
  void empty_cache();
  /// Byte and call counters.
  MemoryStats stats() const;
  /// Sets peak_allocated to the current allocated bytes.
  void reset_peak();
  /// Bytes held in cached (free) blocks.
  size_t cached_bytes() const;
  /// Number of segments obtained from the backend and not yet returned.
  size_t segment_count() const;
  /// The size a request of `bytes` is rounded up to.
  static size_t round_size(size_t bytes);

 private:
  struct Block;
  using EventRef = std::shared_ptr<void>;  // recycled into free_events_ when the last block drops it
  struct BySize {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, BySize>;

  struct StreamEvent {  // an event and the stream it was recorded on
    EventRef event;
    void* stream;
  };
  struct Held {  // a freed block waiting for the events of the other streams that used it
    Block* block;
    std::vector<StreamEvent> events;
  };

  Block* find_free(FreeSet& set, size_t size, void* stream, int pool);
  Block* find_free_other_stream(FreeSet& set, size_t size, void* stream, int pool);
  bool events_done(std::vector<StreamEvent>& events);
  Block* new_segment(size_t size, bool small, void* stream, size_t request, int pool);
  Block* split(Block* b, size_t size);
  void free_block(Block* b);
  void merge_free(Block* b, bool fresh);
  void process_held();
  void release_cached();
  EventRef record_event(void* stream);
  std::string describe() const;

  PoolBackend& backend_;
  std::string name_;
  mutable std::mutex mu_;
  FreeSet small_free_, large_free_;
  std::unordered_map<void*, Block*> live_;     // allocated blocks by address
  std::unordered_map<void*, size_t> segments_;  // bytes of each segment by base address
  std::vector<void*> free_events_;
  std::vector<Held> held_;          // freed, waiting for other streams' events
  std::vector<Block*> deferred_;    // freed during a capture, to be freed when none runs
  std::unordered_map<void*, int> captures_;  // capturing stream -> its private pool
  int next_pool_ = 1;
  MemoryStats stats_;
};

}  // namespace quilt
