// Storage and the aligned host allocator with byte counters.
#include "engine/storage.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

#include "engine/error.h"

namespace quilt {
namespace {

constexpr size_t kAlign = 64;
constexpr size_t kLargeBlock = size_t(1) << 20;  // blocks from 1 MiB up are cached
constexpr size_t kLargeRound = size_t(1) << 16;  // and rounded to 64 KiB

// Host allocator. Large blocks are cached on free and reused best-fit (within 2x), because
// returning them to the system means fresh page faults on every use: a training step that
// allocates the same activations each time would otherwise spend more time faulting pages
// than computing. Small blocks go straight to aligned_alloc (malloc caches those itself).
class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, const Stream&) override {
    const size_t rounded = round(bytes);
    void* p = nullptr;
    if (rounded >= kLargeBlock) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.lower_bound(rounded);
      if (it != cache_.end() && it->first <= 2 * rounded) {
        p = it->second;
        sizes_[p] = it->first;
        cached_ -= int64_t(it->first);
        cache_.erase(it);
      }
    }
    if (!p && rounded) {
      p = std::aligned_alloc(kAlign, rounded);
      if (!p) {  // give the cache back and try once more
        empty_cache();
        p = std::aligned_alloc(kAlign, rounded);
      }
      if (!p) fail("[cpu allocator] out of memory allocating ", bytes, " bytes (", stats().allocated, " in use)");
      ++system_allocs_;
      if (rounded >= kLargeBlock) {
        std::lock_guard<std::mutex> lock(mu_);
        sizes_[p] = rounded;
      }
    }
    const int64_t now = allocated_.fetch_add(int64_t(bytes)) + int64_t(bytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {}
    ++allocs_;
    return p;
  }
  void deallocate(void* p, size_t bytes, const Stream&) override {
    allocated_.fetch_sub(int64_t(bytes));
    if (!p) return;
    if (round(bytes) >= kLargeBlock) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sizes_.find(p);
      if (it != sizes_.end()) {
        cache_.emplace(it->second, p);
        cached_ += int64_t(it->second);
        sizes_.erase(it);
        return;
      }
    }
    std::free(p);
  }
  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, p] : cache_) std::free(p);
    cache_.clear();
    cached_ = 0;
  }
  MemoryStats stats() const {
    MemoryStats s;
    s.allocated = allocated_.load();
    {
      std::lock_guard<std::mutex> lock(mu_);
      s.reserved = s.allocated + cached_;
    }
    s.peak_allocated = peak_.load();
    s.num_allocs = allocs_.load();
    s.num_system_allocs = system_allocs_.load();
    return s;
  }
  void reset_peak() { peak_.store(allocated_.load()); }

 private:
  static size_t round(size_t bytes) {
    const size_t r = (bytes + kAlign - 1) / kAlign * kAlign;
    return r >= kLargeBlock ? (r + kLargeRound - 1) / kLargeRound * kLargeRound : r;
  }
  mutable std::mutex mu_;
  std::multimap<size_t, void*> cache_;          // free large blocks by size
  std::unordered_map<void*, size_t> sizes_;     // live large blocks -> their rounded size
  int64_t cached_ = 0;
  std::atomic<int64_t> allocated_{0}, peak_{0}, allocs_{0}, system_allocs_{0};
};

CpuAllocator& cpu_alloc() {
  static CpuAllocator* a = new CpuAllocator();  // never destroyed: tensors may outlive statics
  return *a;
}

}  // namespace

Allocator* cpu_allocator() { return &cpu_alloc(); }
MemoryStats cpu_memory_stats() { return cpu_alloc().stats(); }
void reset_cpu_peak_memory() { cpu_alloc().reset_peak(); }
void empty_cpu_cache() { cpu_alloc().empty_cache(); }

Storage Storage::allocate(size_t nbytes, Device device) {
  Allocator* alloc = device.is_cpu() ? cpu_allocator() : cuda::allocator(device.index);
  const Stream stream = current_stream(device);
  Storage s;
  s.impl_ = std::make_shared<Impl>();
  s.impl_->data = alloc->allocate(nbytes, stream);
  s.impl_->nbytes = nbytes;
  s.impl_->device = device;
  void* data = s.impl_->data;
  s.impl_->release = [alloc, data, nbytes, stream] { alloc->deallocate(data, nbytes, stream); };
  return s;
}

void Storage::resize_(size_t nbytes) const {
  QUILT_CHECK(impl_ != nullptr, "[storage] resize_ of an undefined storage");
  const Device device = impl_->device;
  if (impl_->release) impl_->release();
  impl_->release = nullptr;
  impl_->data = nullptr;
  impl_->nbytes = 0;
  if (nbytes == 0) return;
  Allocator* alloc = device.is_cpu() ? cpu_allocator() : cuda::allocator(device.index);
  const Stream stream = current_stream(device);
  void* data = alloc->allocate(nbytes, stream);
  impl_->data = data;
  impl_->nbytes = nbytes;
  impl_->release = [alloc, data, nbytes, stream] { alloc->deallocate(data, nbytes, stream); };
}

Storage Storage::allocate_pinned(size_t nbytes) {
  Allocator* alloc = cuda::pinned_host_allocator();
  const Stream stream = current_stream(Device::cpu());
  Storage s;
  s.impl_ = std::make_shared<Impl>();
  s.impl_->data = alloc->allocate(nbytes, stream);
  s.impl_->nbytes = nbytes;
  s.impl_->device = Device::cpu();
  void* data = s.impl_->data;
  s.impl_->release = [alloc, data, nbytes, stream] { alloc->deallocate(data, nbytes, stream); };
  return s;
}

Storage Storage::borrow(void* data, size_t nbytes, Device device, std::function<void()> release) {
  Storage s;
  s.impl_ = std::make_shared<Impl>();
  s.impl_->data = data;
  s.impl_->nbytes = nbytes;
  s.impl_->device = device;
  s.impl_->release = std::move(release);
  return s;
}

}  // namespace quilt
