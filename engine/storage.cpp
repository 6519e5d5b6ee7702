// Storage and the aligned host allocator with byte counters.
#include "engine/storage.h"

#include <atomic>
#include <cstdlib>
#include <new>

#include "engine/error.h"

namespace quilt {
namespace {

constexpr size_t kAlign = 64;

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, const Stream&) override {
    const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    void* p = rounded ? std::aligned_alloc(kAlign, rounded) : nullptr;
    if (rounded && !p) fail("[cpu allocator] out of memory allocating ", bytes, " bytes");
    const int64_t now = allocated_.fetch_add(int64_t(bytes)) + int64_t(bytes);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {}
    ++allocs_;
    return p;
  }
  void deallocate(void* p, size_t bytes, const Stream&) override {
    std::free(p);
    allocated_.fetch_sub(int64_t(bytes));
  }
  MemoryStats stats() const {
    MemoryStats s;
    s.allocated = allocated_.load();
    s.reserved = s.allocated;
    s.peak_allocated = peak_.load();
    s.num_allocs = allocs_.load();
    s.num_system_allocs = s.num_allocs;
    return s;
  }
  void reset_peak() { peak_.store(allocated_.load()); }

 private:
  std::atomic<int64_t> allocated_{0}, peak_{0}, allocs_{0};
};

CpuAllocator& cpu_alloc() {
  static CpuAllocator* a = new CpuAllocator();  // never destroyed: tensors may outlive statics
  return *a;
}

}  // namespace

Allocator* cpu_allocator() { return &cpu_alloc(); }
MemoryStats cpu_memory_stats() { return cpu_alloc().stats(); }
void reset_cpu_peak_memory() { cpu_alloc().reset_peak(); }

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
