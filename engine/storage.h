// Memory behind tensors. Storage owns (or borrows, e.g. an mmap) a block of bytes on a
// device; allocators hand blocks out: the CPU one a size-class cache, the CUDA one a
// stream-aware cache.
//
//   Storage s = Storage::allocate(1024, Device::cpu());   // 64-byte aligned, freed with s
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/device.h"

namespace quilt {

/// Hands out device memory. Implementations: CPU (aligned) and CUDA (caching, per device).
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// A block of at least `bytes` usable on `stream` (the stream matters on CUDA only).
  virtual void* allocate(size_t bytes, const Stream& stream) = 0;
  /// Returns a block from allocate(); it becomes reusable once `stream`'s work is done.
  virtual void deallocate(void* ptr, size_t bytes, const Stream& stream) = 0;
  /// Marks the live block `ptr` as used on `stream` as well: once freed, it is reused only after
  /// the work queued there up to the free has completed. False when this allocator has no
  /// streams to track (the host's), so the caller must keep the block alive itself.
  virtual bool record_stream(void* ptr, const Stream& stream) { return false; }
};

/// Byte counters of an allocator.
struct MemoryStats {
  int64_t allocated = 0;       // bytes in live blocks
  int64_t reserved = 0;        // bytes held from the system (cached + live)
  int64_t peak_allocated = 0;  // high-water mark of `allocated`
  int64_t num_allocs = 0;      // allocate() calls served
  int64_t num_system_allocs = 0;  // allocations that went to the system (cache misses)
};

/// The process-wide host allocator (64-byte aligned; blocks from 64 KiB up are cached).
Allocator* cpu_allocator();
/// Counters of the host allocator.
MemoryStats cpu_memory_stats();
/// Resets peak_allocated of the host allocator to the current allocated bytes.
void reset_cpu_peak_memory();
/// Returns every cached (free) block of the host allocator to the system.
void empty_cpu_cache();
/// Bytes held in the host allocator's cached (free) blocks.
int64_t cpu_cached_bytes();
/// Caps the host allocator's cached bytes (0: cache nothing); trims the cache to it at once.
/// The default is QUILT_CPU_CACHE_MAX ("512M", "4G", "1073741824") or a quarter of RAM.
void set_cpu_cache_limit(int64_t bytes);
/// The cap on the host allocator's cached bytes.
int64_t cpu_cache_limit();
/// The size class a host request of `bytes` is served from (what `reserved` counts for it).
size_t cpu_size_class(size_t bytes);
/// Bytes from a QUILT_CPU_CACHE_MAX value: digits with an optional K, M, G or T (powers of 1024).
/// Throws quilt::Error naming the value when it is malformed.
int64_t parse_cpu_cache_limit(const std::string& value);

namespace cuda {
/// Page-locked host memory (cached): staging buffers for device copies. Without CUDA, the
/// ordinary host allocator.
Allocator* pinned_host_allocator();
/// The caching allocator of device `device` (throws when CUDA is unavailable).
Allocator* allocator(int device);
/// Counters of device `device`'s caching allocator.
MemoryStats memory_stats(int device);
/// Releases every cached (unused) block of device `device` to the driver.
void empty_cache(int device);
/// Resets peak_allocated of device `device` to its current allocated bytes.
void reset_peak_memory(int device);
}  // namespace cuda

/// A block of bytes on one device; shared by every tensor that views it.
class Storage {
 public:
  Storage() = default;
  /// Allocates `nbytes` on `device` (current stream) through that device's allocator.
  static Storage allocate(size_t nbytes, Device device);
  /// Allocates `nbytes` of page-locked host memory (ordinary host memory without CUDA).
  static Storage allocate_pinned(size_t nbytes);
  /// Wraps memory owned elsewhere; `release` runs when the last view goes away.
  static Storage borrow(void* data, size_t nbytes, Device device, std::function<void()> release);

  void* data() const { return impl_ ? impl_->data : nullptr; }
  size_t nbytes() const { return impl_ ? impl_->nbytes : 0; }
  Device device() const { return impl_ ? impl_->device : Device::cpu(); }
  bool defined() const { return impl_ != nullptr; }
  /// Number of Storage handles sharing this block.
  long use_count() const { return impl_.use_count(); }
  /// Identity of the block (two storages alias iff equal).
  const void* id() const { return impl_.get(); }
  /// Frees the block and, when `nbytes` > 0, puts a fresh one of that size (contents
  /// undefined) in its place, seen by every tensor viewing this storage. FSDP frees gathered
  /// parameters after forward this way and refills them before backward, while the autograd
  /// graph keeps its views. Only for allocated (not borrowed) storage.
  void resize_(size_t nbytes) const;
  /// The block is used on `stream` too (not the stream it was allocated on): its allocator
  /// reuses it only after that stream's work up to the free is done. False when the storage is
  /// borrowed or its allocator tracks no streams; then the caller keeps it alive until done.
  bool record_stream(const Stream& stream) const;
  /// True for page-locked host memory (allocate_pinned with CUDA present): what an
  /// asynchronous copy to or from a device needs.
  bool is_pinned() const;

 private:
  struct Impl {
    void* data = nullptr;
    size_t nbytes = 0;
    Device device;
    std::function<void()> release;
    Allocator* allocator = nullptr;  // null when borrowed
    ~Impl() { if (release) release(); }
  };
  std::shared_ptr<Impl> impl_;
};

}  // namespace quilt
