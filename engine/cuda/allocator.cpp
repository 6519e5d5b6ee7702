// The CUDA caching allocator: one CachingPool per device (engine/caching_pool.h) over
// cudaMalloc/cudaFree and CUDA events, plus the per-device counters of engine/storage.h.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/caching_pool.h"
#include "engine/cuda/device_guard.h"
#include "engine/device.h"
#include "engine/error.h"
#include "engine/storage.h"
#include "kernels/cuda/check.cuh"
#include "kernels/cuda/kernels.h"

namespace quilt {
namespace {

class CudaBackend final : public PoolBackend {
 public:
  explicit CudaBackend(int device) : device_(device) {}

  void* malloc(size_t bytes) override {
    cuda_detail::DeviceGuard g(device_);
    void* p = nullptr;
    // A graph capture in global mode refuses cudaMalloc on this thread, but a new segment for
    // the capture's private pool must come from it (it enqueues nothing the graph would miss):
    // this thread relaxes its capture mode for the call and restores it after.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    QUILT_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode));
    const cudaError_t err = cudaMalloc(&p, bytes);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky: clear it so the retry and later calls start clean
      return nullptr;
    }
    QUILT_CHECK_CUDA(err);
    return p;
  }
  void free(void* ptr) override {
    cuda_detail::DeviceGuard g(device_);
    QUILT_CHECK_CUDA(cudaFree(ptr));
  }
  void* event_create() override {
    cuda_detail::DeviceGuard g(device_);
    cudaEvent_t e = nullptr;
    QUILT_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void event_destroy(void* ev) override { cudaEventDestroy(static_cast<cudaEvent_t>(ev)); }
  void event_record(void* ev, void* stream) override {
    QUILT_CHECK_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(ev), static_cast<cudaStream_t>(stream)));
  }
  bool event_query(void* ev) override {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(ev));
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    QUILT_CHECK_CUDA(err);
    return true;
  }
  void event_synchronize(void* ev) override { QUILT_CHECK_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(ev))); }

 private:
  int device_;
};

class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int device) : device_(device), backend_(device), pool_(backend_, "cuda:" + std::to_string(device)) {}

  void* allocate(size_t bytes, const Stream& stream) override {
    QUILT_CHECK(stream.device == Device::cuda(device_), "[cuda allocator] cuda:", device_,
                " was asked for memory on a stream of ", stream.device.str());
    return pool_.allocate(bytes, stream.handle);
  }
  // Runs from Storage's destructor, so it must not throw. The one expected failure is a
  // tensor outliving the CUDA runtime at process exit; its memory goes with the process.
  void deallocate(void* ptr, size_t, const Stream&) override {
    try {
      pool_.deallocate(ptr);
    } catch (const std::exception& e) {
      static std::once_flag warned;
      std::call_once(warned, [&] { std::fprintf(stderr, "quilt: [cuda allocator] free failed: %s\n", e.what()); });
    }
  }
  bool record_stream(void* ptr, const Stream& stream) override {
    QUILT_CHECK(stream.device == Device::cuda(device_), "[record_stream] a block of cuda:", device_,
                " recorded on a stream of ", stream.device.str());
    pool_.record_stream(ptr, stream.handle);
    return true;
  }
  CachingPool& pool() { return pool_; }

 private:
  int device_;
  CudaBackend backend_;
  CachingPool pool_;
};

// Kernels' scratch memory (kernels/cuda/kernels.h) comes from the caching allocator too.
void* workspace_alloc(size_t bytes, int device, void* stream) {
  return cuda::allocator(device)->allocate(bytes, Stream{Device::cuda(device), stream});
}
void workspace_free(void* ptr, int device, void* stream) {
  cuda::allocator(device)->deallocate(ptr, 0, Stream{Device::cuda(device), stream});
}
[[maybe_unused]] const bool g_workspace_installed =
    (kernels::cuda::set_workspace_allocator(workspace_alloc, workspace_free), true);

// One allocator per device, created on first use and never destroyed (tensors may outlive statics).
std::mutex g_mu;
std::vector<CudaAllocator*>& registry() {
  static auto* r = new std::vector<CudaAllocator*>();
  return *r;
}

CudaAllocator* existing(int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& r = registry();
  return device >= 0 && device < int(r.size()) ? r[size_t(device)] : nullptr;
}

}  // namespace

namespace cuda {

namespace {
// Page-locked host blocks, cached by exact size (staging buffers repeat their sizes step after
// step, and cudaHostAlloc is expensive). Falls back to ordinary memory when CUDA is absent.
// A block a stream copied from or into (record_stream: an asynchronous copy) is freed into a
// pending list with an event per such stream, and cached only once they have all completed.
class PinnedHostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes, const Stream&) override {
    if (bytes == 0) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    collect_pending();
    auto it = cache_.find(bytes);
    if (it != cache_.end()) {
      void* p = it->second;
      cache_.erase(it);
      return p;
    }
    void* p = nullptr;
    if (host_alloc(&p, bytes) != cudaSuccess) {
      cudaGetLastError();
      for (auto& [size, q] : cache_) cudaFreeHost(q);
      cache_.clear();
      QUILT_CHECK(host_alloc(&p, bytes) == cudaSuccess, "[cuda] cannot allocate ", bytes, " bytes of pinned host memory");
    }
    return p;
  }
  // Called from Storage's destructor: never throws (a failed event keeps the block out of use).
  void deallocate(void* p, size_t bytes, const Stream&) override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    // A block a captured copy reads is read again at every replay: never handed out again. So
    // is one freed during a capture, when no event may be recorded.
    if (captured_.erase(p) > 0 || (streams_.count(p) > 0 && capture_underway())) {
      streams_.erase(p);
      return;
    }
    auto used = streams_.find(p);
    if (used == streams_.end()) {
      cache_.emplace(bytes, p);
      return;
    }
    Pending pending{.ptr = p, .bytes = bytes, .events = {}};
    bool recorded = true;
    for (const Stream& s : used->second) {
      cuda_detail::DeviceGuard g(s.device.index);
      cudaEvent_t e = nullptr;
      recorded = recorded && cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess &&
                 cudaEventRecord(e, static_cast<cudaStream_t>(s.handle)) == cudaSuccess;
      if (e) pending.events.push_back(e);
    }
    streams_.erase(used);
    if (!recorded) {
      cudaGetLastError();
      return;
    }
    pending_.push_back(std::move(pending));
  }
  bool record_stream(void* p, const Stream& s) override {
    if (!p || !s.device.is_cuda()) return false;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const bool capturing = cudaStreamIsCapturing(static_cast<cudaStream_t>(s.handle), &status) == cudaSuccess &&
                           status != cudaStreamCaptureStatusNone;
    std::lock_guard<std::mutex> lock(mu_);
    if (capturing) captured_.insert(p);
    std::vector<Stream>& list = streams_[p];
    for (const Stream& x : list)
      if (x.device == s.device && x.handle == s.handle) return true;
    list.push_back(s);
    return true;
  }

 private:
  struct Pending {
    void* ptr = nullptr;
    size_t bytes = 0;
    std::vector<cudaEvent_t> events;
  };
  // Caches the pending blocks whose streams are past their copies (never during a capture,
  // when querying an event is illegal).
  void collect_pending() {
    if (pending_.empty() || capture_underway()) return;
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool done = true;
      for (cudaEvent_t e : it->events) done = done && cudaEventQuery(e) == cudaSuccess;
      cudaGetLastError();  // a not-ready query leaves an error code behind
      if (!done) {
        ++it;
        continue;
      }
      for (cudaEvent_t e : it->events) cudaEventDestroy(e);
      cache_.emplace(it->bytes, it->ptr);
      it = pending_.erase(it);
    }
  }
  // cudaHostAlloc in the thread's relaxed capture mode: a capture elsewhere must not refuse it.
  static cudaError_t host_alloc(void** p, size_t bytes) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t err = cudaHostAlloc(p, bytes, cudaHostAllocDefault);
    cudaThreadExchangeStreamCaptureMode(&mode);
    return err;
  }
  std::mutex mu_;
  std::multimap<size_t, void*> cache_;
  std::unordered_map<void*, std::vector<Stream>> streams_;  // live blocks used by streams
  std::unordered_set<void*> captured_;                      // live blocks a captured copy uses
  std::list<Pending> pending_;
};
}  // namespace

Allocator* pinned_host_allocator() {
  if (!is_available()) return cpu_allocator();
  static PinnedHostAllocator* a = new PinnedHostAllocator();  // outlives tensors freed at exit
  return a;
}

Allocator* allocator(int device) {
  QUILT_CHECK(is_available(), "[cuda] no CUDA allocator for cuda:", device, ": CUDA is not available (",
              unavailable_reason(), ")");
  QUILT_CHECK(device >= 0 && device < device_count(), "[cuda] no device cuda:", device, ": this process sees ",
              device_count(), " CUDA device(s)");
  std::lock_guard<std::mutex> lock(g_mu);
  auto& r = registry();
  if (r.size() < size_t(device_count())) r.resize(size_t(device_count()), nullptr);
  if (!r[size_t(device)]) r[size_t(device)] = new CudaAllocator(device);
  return r[size_t(device)];
}

MemoryStats memory_stats(int device) {
  CudaAllocator* a = existing(device);
  return a ? a->pool().stats() : MemoryStats{};
}

void empty_cache(int device) {
  if (CudaAllocator* a = existing(device)) a->pool().empty_cache();
}

void reset_peak_memory(int device) {
  if (CudaAllocator* a = existing(device)) a->pool().reset_peak();
}

}  // namespace cuda

namespace detail {

namespace {
std::map<std::pair<int, int>, int>& pool_users() {  // (device, pool) -> graphs using it
  static auto* m = new std::map<std::pair<int, int>, int>();
  return *m;
}
}  // namespace

int cuda_pool_begin_capture(int device, void* stream, int pool) {
  auto* a = static_cast<CudaAllocator*>(cuda::allocator(device));
  const int id = a->pool().begin_capture(stream, pool);
  std::lock_guard<std::mutex> lock(g_mu);
  ++pool_users()[{device, id}];
  return id;
}

void cuda_pool_end_capture(int device, void* stream) {
  static_cast<CudaAllocator*>(cuda::allocator(device))->pool().end_capture(stream);
}

void cuda_pool_release(int device, int pool, void* replay_stream) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = pool_users().find({device, pool});
    if (it == pool_users().end()) return;
    if (--it->second > 0) return;
    pool_users().erase(it);
  }
  static_cast<CudaAllocator*>(cuda::allocator(device))->pool().release_pool(pool, replay_stream);
}

}  // namespace detail

}  // namespace quilt
