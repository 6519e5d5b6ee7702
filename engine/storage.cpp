// Storage and the caching host allocator with byte counters.
#include "engine/storage.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/error.h"

namespace quilt {
namespace {

constexpr size_t kAlign = 64;
constexpr size_t kCacheMin = size_t(64) << 10;  // requests from 64 KiB up are cached
constexpr size_t kMinStep = size_t(4) << 10;    // size classes are whole pages
constexpr int kClassesPerOctave = 8;            // classes 2^n * (1 + i/8): at most 12.5% waste
constexpr size_t kMaxRequest = size_t(1) << 56;  // beyond any machine; keeps the rounding exact

size_t size_class(size_t bytes) {
  const size_t r = (bytes + kAlign - 1) / kAlign * kAlign;
  if (r < kCacheMin) return r;
  const size_t octave = size_t(1) << (63 - __builtin_clzll(r));
  const size_t step = std::max(kMinStep, octave / kClassesPerOctave);
  return (r + step - 1) / step * step;
}

int64_t default_cache_limit() {
  if (const char* v = std::getenv("QUILT_CPU_CACHE_MAX"); v && *v) return parse_cpu_cache_limit(v);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return int64_t(4) << 30;
  return int64_t(pages) * int64_t(page) / 4;
}

bool malloc_tuned_by_user() {
  for (const char* v : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"})
    if (std::getenv(v)) return true;
  const char* t = std::getenv("GLIBC_TUNABLES");
  return t && std::strstr(t, "glibc.malloc.");
}

// True when the environment variable `name` is "0" (an opt-out of a default).
bool env_off(const char* name) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, "0") == 0;
}

// glibc's malloc serves blocks from 128 KiB up with mmap until one is freed, then raises that
// threshold to the block's size and gives back to the system whatever lies free beyond twice
// it at the top of a heap. The GEMM libraries allocate their packing buffers per call (oneDNN
// several MiB for a large GEMM) and free them at its end, so every call faulted those pages in
// afresh: a single-threaded 512 x 768 x 2048 f32 GEMM ran 1.5x slower on the calls that did.
// Unless the user tuned malloc (a MALLOC_*_ variable, glibc.malloc tunables) or set
// QUILT_MALLOC_KEEP=0, requests below 32 MiB (glibc's largest threshold) come from the heaps and
// up to 256 MiB free at a heap's top stays mapped, so buffers freed by one call serve the next.
void keep_malloc_heaps() {
#ifdef __GLIBC__
  if (env_off("QUILT_MALLOC_KEEP") || malloc_tuned_by_user()) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
#endif
}

// Host allocator. Requests from 64 KiB up are rounded to a size class (eight per power of two)
// and served from pages mapped for them; freed blocks stay cached and serve the next request
// of their class (or of one up to a quarter smaller), because returning them to the system
// means the kernel zeroes fresh pages on every use: a training step that allocates the same
// activations each time would spend a good part of its time faulting pages in. The cache is
// capped (the least recently freed blocks go back to the system first), emptied on request and
// when the system refuses a block (then the request is retried once). Smaller requests go to
// aligned_alloc: malloc keeps such chunks in its own free lists.
class CpuAllocator final : public Allocator {
 public:
  CpuAllocator() : limit_(default_cache_limit()) { keep_malloc_heaps(); }

  void* allocate(size_t bytes, const Stream&) override {
    if (bytes > kMaxRequest) oom(bytes, 0);
    const size_t cls = size_class(bytes);
    void* p = nullptr;
    if (cls >= kCacheMin) {
      size_t size = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = by_size_.lower_bound(cls);
        if (it != by_size_.end() && it->first <= cls + cls / 4) {
          it = std::prev(by_size_.upper_bound(it->first));  // the most recently freed of that size
          const auto block = it->second;
          p = block->ptr;
          size = block->size;
          cached_ -= int64_t(size);
          by_size_.erase(it);
          lru_.erase(block);
          live_.emplace(p, size);
        }
      }
      if (!p) {
        size = cls;
        p = map_pages(size);
        if (!p) {  // give the cache back and try once more
          empty_cache();
          p = map_pages(size);
        }
        if (!p) oom(bytes, cls);
        held_.fetch_add(int64_t(size));
        ++system_allocs_;
        std::lock_guard<std::mutex> lock(mu_);
        live_.emplace(p, size);
      }
    } else if (cls) {
      p = std::aligned_alloc(kAlign, cls);
      if (!p) {
        empty_cache();
        p = std::aligned_alloc(kAlign, cls);
      }
      if (!p) oom(bytes, cls);
      held_.fetch_add(int64_t(cls));
      ++system_allocs_;
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
    const size_t cls = size_class(bytes);
    if (cls < kCacheMin) {
      std::free(p);
      held_.fetch_sub(int64_t(cls));
      return;
    }
    std::vector<std::pair<void*, size_t>> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(p);
      QUILT_CHECK(it != live_.end(), "[cpu allocator] deallocate of a block it did not hand out (", bytes, " bytes)");
      const size_t size = it->second;
      live_.erase(it);
      if (int64_t(size) > limit_) {
        release.emplace_back(p, size);
      } else {
        lru_.push_front(FreeBlock{p, size, {}});
        lru_.front().by_size = by_size_.emplace(size, lru_.begin());
        cached_ += int64_t(size);
        trim_locked(limit_, release);
      }
    }
    unmap_all(release);
  }

  void empty_cache() {
    std::vector<std::pair<void*, size_t>> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      trim_locked(0, release);
    }
    unmap_all(release);
  }

  void set_limit(int64_t bytes) {
    QUILT_CHECK(bytes >= 0, "[cpu allocator] the cache limit must be >= 0 bytes, got ", bytes);
    std::vector<std::pair<void*, size_t>> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      limit_ = bytes;
      trim_locked(limit_, release);
    }
    unmap_all(release);
  }
  int64_t limit() const {
    std::lock_guard<std::mutex> lock(mu_);
    return limit_;
  }
  int64_t cached() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_;
  }

  MemoryStats stats() const {
    MemoryStats s;
    s.allocated = allocated_.load();
    s.reserved = held_.load();
    s.peak_allocated = peak_.load();
    s.num_allocs = allocs_.load();
    s.num_system_allocs = system_allocs_.load();
    return s;
  }
  void reset_peak() { peak_.store(allocated_.load()); }

 private:
  struct FreeBlock;
  using Lru = std::list<FreeBlock>;  // cached blocks, most recently freed first
  struct FreeBlock {
    void* ptr;
    size_t size;
    std::multimap<size_t, Lru::iterator>::iterator by_size;
  };

  // Fresh pages for a block. From 2 MiB up the block starts on a 2 MiB boundary and is marked
  // for transparent huge pages (where the system grants them on request, the common
  // "madvise" setting): its first touch then faults once per 2 MiB instead of once per 4 KiB,
  // and large GEMM operands need 512x fewer TLB entries. QUILT_HUGEPAGES=0 leaves 4 KiB pages.
  static void* map_pages(size_t size) {
    constexpr size_t kHuge = size_t(2) << 20;
    static const bool huge = !env_off("QUILT_HUGEPAGES");
    if (!huge || size < kHuge) {
      void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      return p == MAP_FAILED ? nullptr : p;
    }
    // Map a 2 MiB slack, keep the aligned part and return the rest.
    void* raw = mmap(nullptr, size + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (begin + kHuge - 1) / kHuge * kHuge;
    if (aligned > begin) munmap(raw, aligned - begin);
    const uintptr_t end = begin + size + kHuge, used_end = aligned + size;
    if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
    void* p = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
    madvise(p, size, MADV_HUGEPAGE);  // advice only: where it is refused, 4 KiB pages serve
#endif
    return p;
  }
  void unmap_all(const std::vector<std::pair<void*, size_t>>& blocks) {
    for (const auto& [p, size] : blocks) {
      munmap(p, size);
      held_.fetch_sub(int64_t(size));
    }
  }
  // Moves the least recently freed blocks out of the cache until it holds at most `limit` bytes.
  void trim_locked(int64_t limit, std::vector<std::pair<void*, size_t>>& release) {
    while (cached_ > limit && !lru_.empty()) {
      const FreeBlock& b = lru_.back();
      release.emplace_back(b.ptr, b.size);
      cached_ -= int64_t(b.size);
      by_size_.erase(b.by_size);
      lru_.pop_back();
    }
  }
  [[noreturn]] void oom(size_t bytes, size_t cls) const {
    const MemoryStats s = stats();
    fail("[cpu allocator] out of memory allocating ", bytes, " bytes", cls ? " (size class " : "",
         cls ? std::to_string(cls) + ")" : std::string(), "; ", s.allocated, " bytes in use, ", s.reserved,
         " reserved, cache limit ", limit(), " bytes");
  }

  mutable std::mutex mu_;
  Lru lru_;
  std::multimap<size_t, Lru::iterator> by_size_;  // cached blocks by size
  std::unordered_map<void*, size_t> live_;        // handed-out cached-class blocks -> their size
  int64_t cached_ = 0;
  int64_t limit_;
  std::atomic<int64_t> allocated_{0}, held_{0}, peak_{0}, allocs_{0}, system_allocs_{0};
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
int64_t cpu_cached_bytes() { return cpu_alloc().cached(); }
void set_cpu_cache_limit(int64_t bytes) { cpu_alloc().set_limit(bytes); }
int64_t cpu_cache_limit() { return cpu_alloc().limit(); }
size_t cpu_size_class(size_t bytes) { return size_class(bytes); }

int64_t parse_cpu_cache_limit(const std::string& value) {
  size_t i = 0;
  int64_t n = 0;
  bool overflow = false;
  while (i < value.size() && std::isdigit(static_cast<unsigned char>(value[i]))) {
    if (n > (INT64_MAX - 9) / 10) overflow = true;
    else n = n * 10 + (value[i] - '0');
    ++i;
  }
  const bool digits = i > 0;
  int shift = 0;
  if (i < value.size()) {
    switch (std::toupper(static_cast<unsigned char>(value[i]))) {
      case 'K': shift = 10; ++i; break;
      case 'M': shift = 20; ++i; break;
      case 'G': shift = 30; ++i; break;
      case 'T': shift = 40; ++i; break;
      default: break;
    }
  }
  if (shift && i < value.size() && (value[i] == 'B' || value[i] == 'b')) ++i;
  if (shift && n > (INT64_MAX >> shift)) overflow = true;
  QUILT_CHECK(digits && i == value.size() && !overflow, "[cpu allocator] QUILT_CPU_CACHE_MAX=\"", value,
              "\" is not a byte count (digits with an optional K, M, G or T, e.g. 512M)");
  return n << shift;
}

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
  s.impl_->allocator = alloc;
  return s;
}

void Storage::resize_(size_t nbytes) const {
  QUILT_CHECK(impl_ != nullptr, "[storage] resize_ of an undefined storage");
  const Device device = impl_->device;
  if (impl_->release) impl_->release();
  impl_->release = nullptr;
  impl_->allocator = nullptr;
  impl_->data = nullptr;
  impl_->nbytes = 0;
  if (nbytes == 0) return;
  Allocator* alloc = device.is_cpu() ? cpu_allocator() : cuda::allocator(device.index);
  const Stream stream = current_stream(device);
  void* data = alloc->allocate(nbytes, stream);
  impl_->data = data;
  impl_->nbytes = nbytes;
  impl_->release = [alloc, data, nbytes, stream] { alloc->deallocate(data, nbytes, stream); };
  impl_->allocator = alloc;
}

bool Storage::record_stream(const Stream& stream) const {
  if (!impl_ || !impl_->allocator || !impl_->data) return false;
  return impl_->allocator->record_stream(impl_->data, stream);
}

bool Storage::is_pinned() const {
  return impl_ && impl_->allocator && impl_->device.is_cpu() && cuda::is_available() &&
         impl_->allocator == cuda::pinned_host_allocator();
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
  s.impl_->allocator = alloc;
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
